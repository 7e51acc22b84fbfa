"""--fail-if: a CI gate on a run's summary. A failing gate writes everything and exits 1; an unknown metric is one
line and exit 2 before anything loads; the verdict is in manifest.json. Toy stacks, no engine."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.errors import ProbeError
from divergence_probe.reports.gate import METRICS, Condition, Gate


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)


@pytest.fixture
def toy_args(toy, qwen3_tiny, prompts_file):
    return ["--model", qwen3_tiny, "--infer", "toy-fused", "--train", "toy", "--prompts", prompts_file,
            "--taps", "none"]


def test_a_gate_that_holds_fails_the_run_after_writing_it(toy_args, tmp_path):
    result = invoke("compare", *toy_args, "--fail-if", "mean_abs_dlogp>0", "--fail-if", "mean_kl<0",
                    "--out", tmp_path / "run")
    assert result.exit_code == 1, result.output
    summary = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert "gate failed: mean_abs_dlogp>0" in result.output and f"{summary.mean_abs_dlogp[0]:.6g}" in result.output
    assert "mean_kl<0" not in result.output.split("run:")[-1]
    gate = json.loads((tmp_path / "run" / "manifest.json").read_text())["gate"]
    assert gate["passed"] is False and [f["condition"] for f in gate["failed"]] == ["mean_abs_dlogp>0"]
    assert gate["fail_if"] == ["mean_abs_dlogp>0", "mean_kl<0"]


def test_a_gate_that_does_not_hold_passes(toy_args, tmp_path):
    result = invoke("compare", *toy_args, "--fail-if", "mean_abs_dlogp>1e6", "--fail-if", "mean_kl<0",
                    "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["gate"]["passed"] is True


def test_unknown_metric_is_one_line_before_anything_loads(toy_args, tmp_path, monkeypatch):
    import divergence_probe.runs.loading as loading

    monkeypatch.setattr(loading, "stack_for", lambda *a: pytest.fail("a stack loaded before the gate was checked"))
    result = invoke("compare", *toy_args, "--fail-if", "mean_kll>1", "--out", tmp_path / "run")
    assert result.exit_code == 2 and "no metric 'mean_kll'" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("condition, named", [
    ("mean_abs_dlogp>nan", "not a finite number"),
    ("mean_kl<inf", "not a finite number"),
    ("mean_kl>1e999", "not a finite number"),
    ("mean_kl==1e-3x", "mean_kl is a number and '1e-3x' is not one"),
    ("first_inexact==attn_core@0", "add --taps all"),  # the toy run captures no taps (--taps none)
    ("first_inexact!=0", "first_inexact is a word"),
    ("mismatch_over_floor>2", "add --batch-invariance"),
    ("noise_train_mean_abs_dlogp>0.1", "add --batch-invariance"),
    ("k3>1e-3", "add --mode generate"),
    ("noise_infer_engine_mode_mean_abs_dlogp>0.1", "add --engine-noise"),
    ("frac_tokens_any_flip>0", "no mixture-of-experts routers"),  # read from the config, before the stacks load
])
def test_a_gate_that_could_never_judge_the_run_is_refused_before_anything_loads(condition, named, toy_args, tmp_path,
                                                                               monkeypatch):
    """A condition that could never hold (a NaN threshold, a mistyped number against a number) or reads a metric
    this run's flags will not measure passes every run: refused in one line, before a stack loads."""
    import divergence_probe.runs.loading as loading

    monkeypatch.setattr(loading, "stack_for", lambda *a: pytest.fail("a stack loaded before the gate was checked"))
    for command, regions in (("compare", []), ("ablate", ["--regions", "toy-align"])):  # the region the toys align
        result = invoke(command, *toy_args, *regions, "--fail-if", condition, "--out", tmp_path / "run")
        assert result.exit_code == 2 and named in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and "--fail-if" in result.output
        assert not (tmp_path / "run").exists()


def test_what_the_flags_measure_is_not_refused():
    from divergence_probe.spec.capture import CaptureSpec
    from divergence_probe.spec.run import RunSpec

    spec = RunSpec(capture=CaptureSpec(batch_invariance=True))
    Gate.parse(["mismatch_over_floor>2", "first_inexact!=attn_core@0", "noise_train_mean_abs_dlogp>1"],
               "compare").check_measured(spec)


def test_words_and_flags_compare_as_their_kind():
    assert Condition.parse("recorded_far==true", "score").value == 1.0  # a bool reads as a number
    assert Condition.parse("first_inexact==none", "compare").value == "none"
    with pytest.raises(ProbeError, match="dominant_factor is a word"):
        Condition.parse("dominant_factor==1", "compare")


def test_a_word_metric_the_run_did_not_capture_fails_closed():
    """--taps none writes first_inexact as 'not captured': no condition on it can vouch for the run, whichever way
    it compares; a word read where the summary holds a number fails too."""
    for text in ("first_inexact==attn_core@0", "first_inexact!=attn_core@0"):
        verdict = Gate.parse([text], "compare").judge([("run", {"first_inexact": "not captured"})])
        assert not verdict.passed and verdict.failures[0].value == "not measured", text
    assert not Gate.parse(["likely_cause==stale_weights"], "score").judge([("run", {"likely_cause": 1.5})]).passed
    assert Gate.parse(["first_inexact==attn_core@0"], "compare").judge([("run", {"first_inexact": "none"})]).passed


def test_an_unmeasured_floor_fails_closed():
    verdict = Gate.parse(["mismatch_over_floor>2"], "compare").judge([("run", {"mean_abs_dlogp": 1.0})])
    assert not verdict.passed and verdict.failures[0].value == "not measured"
    floor = {"mean_abs_dlogp": 1.0, "noise_infer_mean_abs_dlogp": 0.25, "noise_train_mean_abs_dlogp": 0.5}
    assert Gate.parse(["mismatch_over_floor>2"], "compare").judge([("run", floor)]).passed  # 1 / 0.5 = 2
    assert not Gate.parse(["mismatch_over_floor>=2"], "compare").judge([("run", floor)]).passed


@pytest.mark.parametrize("text", ["mean_kl", "mean_kl>>1", "mean_kl=1", "mean_kl>", "1>mean_kl", "mean_kl>big",
                                  "__import__('os')>1"])
def test_bad_conditions_are_refused(text):
    with pytest.raises(ProbeError, match="--fail-if"):
        Condition.parse(text, "compare")


def test_each_kind_names_its_own_metrics():
    assert "likely_cause" in METRICS["score"] and "likely_cause" not in METRICS["compare"]
    assert "first_inexact" in METRICS["ablate"] and "k3" in METRICS["history"]
    with pytest.raises(ProbeError, match="score writes no metric 'first_inexact'"):
        Gate.parse(["first_inexact!=none"], "score")


def test_an_ablation_gate_reads_the_shipped_combination(toy_args, tmp_path):
    result = invoke("ablate", *toy_args, "--regions", "toy-align", "--side", "train", "--bootstrap", "0",
                    "--fail-if", "mean_kl>0", "--out", tmp_path / "a")
    assert result.exit_code == 1, result.output
    ablation = pd.read_csv(tmp_path / "a" / "ablation.csv").set_index("combo")
    assert ablation.loc["none", "mean_kl"] > 0 == ablation.loc["toy-align", "mean_kl"]  # only the shipped one fails
    gate = json.loads((tmp_path / "a" / "manifest.json").read_text())["gate"]
    assert gate["failed"] == [{"condition": "mean_kl>0", "value": ablation.loc["none", "mean_kl"], "where": "combo none"}]


def test_rerun_replays_the_recorded_gate_and_adds_its_own(toy_args, tmp_path):
    """A run whose gate failed fails again when rerun (exit 1, after writing): the recorded conditions are judged
    again, and rerun's own --fail-if conditions are added to them."""
    first = invoke("compare", *toy_args, "--fail-if", "mean_abs_dlogp>0", "--out", tmp_path / "first")
    assert first.exit_code == 1, first.output
    again = invoke("rerun", tmp_path / "first", "--out", tmp_path / "again")
    assert again.exit_code == 1 and "gate failed: mean_abs_dlogp>0" in again.output, again.output
    assert "--fail-if 'mean_abs_dlogp>0'" in again.output  # the `same as:` command line shows the gate
    gate = json.loads((tmp_path / "again" / "manifest.json").read_text())["gate"]
    assert gate["fail_if"] == ["mean_abs_dlogp>0"] and gate["passed"] is False
    added = invoke("rerun", tmp_path / "first", "--fail-if", "mean_kl<0", "--fail-if", "mean_abs_dlogp>0",
                   "--out", tmp_path / "added")
    assert added.exit_code == 1, added.output
    gate = json.loads((tmp_path / "added" / "manifest.json").read_text())["gate"]
    assert gate["fail_if"] == ["mean_abs_dlogp>0", "mean_kl<0"]  # each condition once, the recorded ones first


def test_rerun_of_a_run_without_a_gate_takes_one(toy_args, tmp_path):
    assert invoke("compare", *toy_args, "--out", tmp_path / "first").exit_code == 0
    passing = invoke("rerun", tmp_path / "first", "--fail-if", "mean_abs_dlogp>1e6", "--out", tmp_path / "ok")
    assert passing.exit_code == 0 and "gate passed" in passing.output, passing.output
    failing = invoke("rerun", tmp_path / "first", "--fail-if", "mean_abs_dlogp>0", "--out", tmp_path / "bad")
    assert failing.exit_code == 1 and (tmp_path / "bad" / "summary.csv").is_file(), failing.output


@pytest.mark.parametrize("edit, flags, named", [
    (None, ["--fail-if", "mean_kl>nan"], "not a finite number"),
    (None, ["--fail-if", "mismatch_over_floor>2"], "add --batch-invariance"),
    (lambda gate: gate.update(fail_if=["mean_kl>nan"]), [], "records a gate rerun cannot judge (gate.fail_if)"),
    (lambda gate: gate.update(fail_if="mean_kl>1"), [], "gate.fail_if is not a list"),
])
def test_a_rerun_gate_that_cannot_judge_is_refused_before_anything_loads(edit, flags, named, toy_args, tmp_path,
                                                                         monkeypatch):
    assert invoke("compare", *toy_args, "--fail-if", "mean_kl<0", "--out", tmp_path / "first").exit_code == 0
    if edit is not None:
        path = tmp_path / "first" / "manifest.json"
        manifest = json.loads(path.read_text())
        edit(manifest["gate"])
        path.write_text(json.dumps(manifest))
    import divergence_probe.runs.loading as loading

    monkeypatch.setattr(loading, "stack_for", lambda *a: pytest.fail("a stack loaded before the gate was checked"))
    result = invoke("rerun", tmp_path / "first", *flags, "--out", tmp_path / "again")
    assert result.exit_code == 2 and named in result.output, result.output
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("recorded, named", [
    ("first_inexact==attn_core@0", "will not measure first_inexact"),  # the run has --taps none
    ("mean_kl>nan", "not a finite number"),
])
def test_a_recorded_gate_rerun_cannot_judge_names_the_way_out(recorded, named, toy_args, tmp_path):
    """A run folder whose recorded gate is now refused (recorded by an older version, or edited): the one line says
    it is the recorded gate and how to rerun without it, and --no-recorded-gate reruns judged by rerun's own
    --fail-if alone."""
    assert invoke("compare", *toy_args, "--fail-if", "mean_kl<0", "--out", tmp_path / "first").exit_code == 0
    path = tmp_path / "first" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["gate"]["fail_if"] = [recorded]
    path.write_text(json.dumps(manifest))
    refused = invoke("rerun", tmp_path / "first", "--out", tmp_path / "again")
    assert refused.exit_code == 2 and named in refused.output and "--no-recorded-gate" in refused.output, \
        refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "again").exists()
    again = invoke("rerun", tmp_path / "first", "--no-recorded-gate", "--fail-if", "mean_abs_dlogp>0",
                   "--out", tmp_path / "again")
    assert again.exit_code == 1, again.output
    gate = json.loads((tmp_path / "again" / "manifest.json").read_text())["gate"]
    assert gate["fail_if"] == ["mean_abs_dlogp>0"]


def test_rerun_of_an_rl_folder_takes_no_gate(tmp_path):
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "rl.csv").write_text("setting,seed,step\n")
    result = invoke("rerun", tmp_path / "rl", "--fail-if", "mean_kl>1", "--out", tmp_path / "again")
    assert result.exit_code == 2 and "an rl run has none to gate" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "again").exists()
