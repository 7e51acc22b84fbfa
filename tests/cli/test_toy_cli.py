"""The orchestration, the run folder and the CLI on a toy stack and a toy region (no engine): a new stack or
region is one file plus one registry line, and `rerun` re-makes a run byte for byte."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.numerics.shapley import ALL_REGIONS, CHANGE, SHARE

CSVS = ("tokens.csv", "layers.csv", "summary.csv", "ablation.csv", "attribution.csv", "buckets.csv",
        "batch_invariance.csv", "rollouts.jsonl")


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)
    assert result.exit_code == 0, result.output
    return result


def same_csvs(a, b) -> list[str]:
    names = sorted(p.name for p in a.iterdir() if p.name in CSVS)
    assert names == sorted(p.name for p in b.iterdir() if p.name in CSVS)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    return names


@pytest.fixture
def toy_args(toy, qwen3_tiny, prompts_file):
    return ["--model", qwen3_tiny, "--infer", "toy-fused", "--train", "toy", "--prompts", prompts_file]


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_compare_with_a_toy_stack(toy_args, tmp_path):
    cli("compare", *toy_args, "--out", tmp_path / "run")
    summary = pd.read_csv(tmp_path / "run" / "summary.csv")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["stacks"]["infer"]["name"] == "toy-fused" and manifest["stacks"]["train"]["name"] == "toy"
    assert summary.mean_abs_dlogp[0] > 0  # the two roundings differ in BF16
    assert summary.first_inexact[0] == "input_norm@0"  # the first tap after the first layer that rounds


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_ablate_with_a_toy_region_removes_the_mismatch(toy_args, tmp_path):
    result = cli("ablate", *toy_args, "--regions", "toy-align", "--side", "train", "--bootstrap", "20",
                 "--out", tmp_path / "a")
    ablation = pd.read_csv(tmp_path / "a" / "ablation.csv").set_index("combo")
    assert ablation.loc["none", "mean_kl"] > 0
    assert ablation.loc["toy-align", "mean_kl"] == 0 and ablation.loc["toy-align", "first_inexact"] == "none"
    attribution = pd.read_csv(tmp_path / "a" / "attribution.csv").set_index("region")
    # removing all of the shipped mismatch: a change of -100% of it, the region's and all regions' alike
    assert attribution.loc["toy-align", SHARE] == attribution.loc[ALL_REGIONS, SHARE] == -1.0
    assert attribution.loc["toy-align", CHANGE] == pytest.approx(-ablation.loc["none", "mean_kl"], rel=1e-12)
    # three prompts: too few for an interval, so nothing is claimed as detected and no rl run is proposed on it
    assert attribution.loc["toy-align", "effect"] == attribution.loc[ALL_REGIONS, "effect"] == "no_interval"
    assert "Aligning every region: removes 100% (no interval) of the shipped mean_kl." in result.output
    assert "No region's effect was tested" in result.output and "Detectable" not in result.output
    assert "divergence-probe rl" not in result.output
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["stacks"]["train"]["implementations"]["layer"] == "2 R"  # what it ships, not what was aligned


def test_a_compare_without_taps_shows_no_tap_rows_and_words_its_noise_verdict(toy_args, tmp_path):
    """--taps none: no "not captured" rows. The toy stacks are batch invariant, so the floor is exactly 0: no ratio
    (no inf, no interval), any mismatch above it, the same in summary.csv and the manifest."""
    result = cli("compare", *toy_args, "--taps", "none", "--batch-invariance", "--out", tmp_path / "run")
    assert "not captured" not in result.output and "first inexact tap" not in result.output
    summary = pd.read_csv(tmp_path / "run" / "summary.csv").iloc[0]
    assert summary["noise_infer_mean_abs_dlogp"] == summary["noise_train_mean_abs_dlogp"] == 0
    assert summary["mean_abs_dlogp"] > 0 and summary["noise_verdict"] == "above_floor"
    assert pd.isna(summary["mismatch_over_floor"]) and pd.isna(summary["mismatch_over_floor_ci_low"])
    assert "normal or not" in result.output and "the largest noise floor is exactly 0 and the mismatch is not" in result.output and not re.search(r"\binf\b", result.output)
    record = json.loads((tmp_path / "run" / "manifest.json").read_text())["noise_verdict"]
    assert record["verdict"] == "above_floor" and record["ratio"] is None and record["ci"] == [None, None]


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
@pytest.mark.parametrize("kind, extra", [
    ("compare", ["--taps", "all", "--batch-invariance"]),
    ("compare", ["--mode", "generate", "--max-new-tokens", "5", "--samples-per-prompt", "2", "--temperature", "0.7"]),
    ("ablate", ["--regions", "toy-align", "--side", "both", "--bootstrap", "10", "--ci-level", "0.9"]),
])
def test_rerun_reproduces_the_run_byte_for_byte(toy_args, tmp_path, kind, extra):
    cli(kind, *toy_args, *extra, "--out", tmp_path / "first")
    cli("rerun", tmp_path / "first", "--out", tmp_path / "again")
    assert same_csvs(tmp_path / "first", tmp_path / "again")
    first, again = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("first", "again"))
    assert first["spec"] == again["spec"]


def test_rerun_refuses_changed_prompts(toy_args, tmp_path, prompts_file):
    changed = tmp_path / "prompts.txt"
    changed.write_text(prompts_file.read_text())
    args = [a if a != prompts_file else changed for a in toy_args]
    cli("compare", *args, "--taps", "none", "--out", tmp_path / "first")
    changed.write_text(changed.read_text() + "\n\none more prompt here\n")
    result = CliRunner().invoke(app, ["rerun", str(tmp_path / "first"), "--out", str(tmp_path / "again")])
    assert result.exit_code == 2 and "changed" in result.output
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("prompt_text, message", [("", "No prompts found"), ("x" * 5000 + "\n", "context")])
def test_bad_prompts_fail_before_any_stack_loads(qwen3_tiny, tmp_path, monkeypatch, prompt_text, message):
    import divergence_probe.runs.loading as loading

    def no_stack(name, settings):
        raise AssertionError(f"stack {name} was loaded before the prompts were checked")

    monkeypatch.setattr(loading, "stack_for", no_stack)
    prompts = tmp_path / "p.txt"
    prompts.write_text(prompt_text)
    result = CliRunner().invoke(app, ["compare", "--model", str(qwen3_tiny), "--prompts", str(prompts),
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "run").exists()


def test_probe_methods_refuse_load_settings(toy, qwen3_tiny, prompts_file):
    import divergence_probe as dp
    from divergence_probe.errors import ProbeError

    probe = dp.load(str(qwen3_tiny), infer="toy-fused", train="toy")
    with pytest.raises(ProbeError, match="dtype: load settings"):
        probe.compare(prompts=prompts_file, dtype="float32")
    variant = probe.with_trainer(train="toy-fused")
    assert variant.compare(prompts=prompts_file, taps="none").summary["mean_abs_dlogp"] == 0  # the same roundings
    variant.close()
    assert probe.compare(prompts=prompts_file, taps="none").summary["mean_abs_dlogp"] > 0  # its engine still open


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_a_generate_run_exports_rollouts_that_score_reads_back(toy_args, qwen3_tiny, tmp_path):
    """rollouts.jsonl of a generate run, in a framework's layout (--rollouts-format), is a rollout file `score` takes
    as it is (auto-detected as that layout): the scored tokens are the run's sampled ones, with the run's decode
    logprobs as the recording, to the last digit."""
    cli("compare", *toy_args, "--mode", "generate", "--max-new-tokens", "5", "--samples-per-prompt", "2",
        "--temperature", "0.7", "--rollouts-format", "slime", "--out", tmp_path / "gen")
    manifest = json.loads((tmp_path / "gen" / "manifest.json").read_text())
    assert manifest["files"]["rollouts.jsonl"]["rows"] == len((tmp_path / "gen" / "rollouts.jsonl").read_text().splitlines())
    cli("score", tmp_path / "gen" / "rollouts.jsonl", "--model", qwen3_tiny, "--device", "cpu", "--out",
        tmp_path / "scored")
    generated = pd.read_csv(tmp_path / "gen" / "tokens.csv", dtype=str, keep_default_na=False)
    generated = generated[generated.is_response == "True"].reset_index(drop=True)
    scored = pd.read_csv(tmp_path / "scored" / "tokens.csv", dtype=str, keep_default_na=False)
    for column in ("prompt_id", "sample_id", "position", "token_id"):
        assert scored[column].tolist() == generated[column].tolist(), column
    assert scored.logprob_rollout.tolist() == generated.logprob_infer.tolist()
    assert json.loads((tmp_path / "scored" / "manifest.json").read_text())["score"]["format"] == "slime"


def test_compare_records_its_phase_seconds_only_when_asked(toy_args, tmp_path, monkeypatch):
    """DIVERGENCE_PROBE_TIMINGS=1: the manifest says where the run's wall time went (timings.py); without it, nothing
    is recorded. --taps none: no reduction to compile."""
    monkeypatch.delenv("DIVERGENCE_PROBE_TIMINGS", raising=False)
    cli("compare", *toy_args, "--taps", "none", "--out", tmp_path / "off")
    assert "timings" not in json.loads((tmp_path / "off" / "manifest.json").read_text())
    monkeypatch.setenv("DIVERGENCE_PROBE_TIMINGS", "1")
    cli("compare", *toy_args, "--taps", "none", "--batch-invariance", "--out", tmp_path / "on")
    timings = json.loads((tmp_path / "on" / "manifest.json").read_text())["timings"]
    phases = {"start", "load", "load.train", "load.infer", "run", "run.score", "run.score.infer", "run.score.train",
              "run.noise_floor.batch", "run.noise_floor.kernel", "until_written"}
    assert phases <= set(timings) and "run.noise_floor.engine" not in timings  # only what ran
    assert all(s >= 0 for s in timings.values())
    # a parent includes its children, and the run so far includes the load and the run
    assert timings["run.score"] >= timings["run.score.infer"] + timings["run.score.train"] - 0.01
    assert timings["until_written"] >= timings["start"] + timings["load"] + timings["run"] - 0.01
