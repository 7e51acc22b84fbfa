"""score without a model: files that record the trainer's logprobs beside the engine's (each framework's own field),
scored from the file alone; many files are a run's history (steps.csv, alarms, figures) with a gate. No stack loads:
every test here runs on synthetic rollouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.numerics.rl_metrics import token_metrics
from divergence_probe.rollouts import RolloutError, read_rollouts
from divergence_probe.runs.manifest import runnable_command
from test_score import _jsonl, _layouts

TRAIN_FIELD = {"generic": "train_logprobs", "verl": "old_log_probs", "openrlhf": "action_log_probs",
               "slime": "log_probs", "trl": "old_per_token_logps"}
ENGINE_FIELD = {"generic": "logprobs", "verl": "rollout_log_probs", "openrlhf": "rollout_log_probs",
                "slime": "rollout_log_probs", "trl": "sampling_per_token_logps"}


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)


def records(seed: int, scale: float, n: int = 6):
    """Rollouts of a tiny vocabulary: engine logprobs, and trainer logprobs `scale` nats apart on average."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(3, 9))
        infer = -rng.uniform(0.05, 3.0, length)
        train = np.minimum(infer + rng.normal(0, scale, length), 0.0)
        out.append({"group": i // 2, "prompt": [int(t) for t in rng.integers(1, 50, 4 + i // 2 * 0)],
                    "response": [int(t) for t in rng.integers(1, 50, length)], "logprobs": infer.tolist(),
                    "train": train.tolist()})
    for r in out:  # a group's samples share their prompt
        r["prompt"] = out[2 * r["group"]]["prompt"]
    return out


def layouts_with_train(recs):
    """Each framework's layout, its trainer field beside its engine field (padded and masked alike)."""
    engine = _layouts(recs)
    trained = _layouts([r | {"logprobs": r["train"]} for r in recs])
    return {fmt: [row | {TRAIN_FIELD[fmt]: t[ENGINE_FIELD[fmt]]} for row, t in zip(engine[fmt], trained[fmt])]
            for fmt in engine}


@pytest.mark.parametrize("fmt", list(TRAIN_FIELD))
def test_each_framework_layout_scores_without_a_model(fmt, tmp_path, monkeypatch):
    import divergence_probe.runs.score as score

    monkeypatch.setattr(score, "load_scorer", lambda *a, **k: pytest.fail("a model loaded"))
    recs = records(0, 0.05)
    path = _jsonl(tmp_path / f"{fmt}.jsonl", layouts_with_train(recs)[fmt])
    result = invoke("score", path, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    tokens = pd.read_csv(tmp_path / "run" / "tokens.csv")
    infer = np.concatenate([r["logprobs"] for r in recs])
    train = np.concatenate([r["train"] for r in recs])
    assert tokens.logprob_rollout.tolist() == infer.tolist() and tokens.logprob_train.tolist() == train.tolist()
    summary = pd.read_csv(tmp_path / "run" / "summary.csv").iloc[0]
    expected = token_metrics(infer, train, 0.2, 2.0)
    for name in ("mean_abs_dlogp", "k3", "frac_abs_dlogp_over_ln2", "ppo_clip_frac", "ess"):
        assert summary[name] == pytest.approx(expected[name], rel=1e-12), name
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["score"]["trainer"] == "recorded" and manifest["score"]["format"] == fmt


@pytest.mark.engine  # a child process (the suite's marker for those)
def test_a_run_started_as_a_module_records_a_command_that_runs(tmp_path):
    """`python -m divergence_probe` puts the package's __main__.py in argv[0]: the manifest and the report's Command
    line say `python -m divergence_probe`, which runs as typed, not the file's path, which does not."""
    path = _jsonl(tmp_path / "r.jsonl", layouts_with_train(records(0, 0.05))["verl"])
    args = ["score", str(path), "--out", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "divergence_probe", *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    command = json.loads((tmp_path / "run" / "manifest.json").read_text())["command"]
    assert command == ["python", "-m", "divergence_probe", *args]
    assert invoke("report", tmp_path / "run").exit_code == 0
    assert f"Command: `python -m divergence_probe {' '.join(args)}`" in (tmp_path / "run/report/report.md").read_text()


def test_the_console_script_is_recorded_by_its_name_and_a_script_as_started():
    assert runnable_command(["/venv/bin/divergence-probe", "compare", "-n", "2"]) == ["divergence-probe", "compare",
                                                                                      "-n", "2"]
    assert runnable_command(["train.py", "--steps", "3"]) == ["train.py", "--steps", "3"]


def test_fields_name_both_logprob_columns(tmp_path):
    recs = records(1, 0.1)
    rows = [{"prompt_ids": r["prompt"], "response_ids": r["response"], "lp_engine": r["logprobs"],
             "lp_actor": r["train"]} for r in recs]
    path = _jsonl(tmp_path / "r.jsonl", rows)
    batch = read_rollouts(path, fields="infer=lp_engine,train=lp_actor")
    assert batch.has_train and [list(r.train_logprobs) for r in batch.rollouts] == [r["train"] for r in recs]
    with pytest.raises(RolloutError, match="no `nope`"):
        read_rollouts(path, fields="infer=lp_engine,train=nope")


def test_a_bad_trainer_column_is_named(tmp_path):
    row = layouts_with_train(records(2, 0.1))["slime"][0]
    row["log_probs"] = row["log_probs"][:-1]
    with pytest.raises(RolloutError, match="`log_probs`"):
        read_rollouts(_jsonl(tmp_path / "r.jsonl", [row]))


SCALES = (0.002, 0.004, 0.05, 0.2, 0.4)  # the mismatch grows step by step, as before a collapse


@pytest.fixture
def steps_folder(tmp_path):
    """A run's history: one verl file per step (numbered out of lexical order: step_2 before step_10), each with
    the step's reward."""
    folder = tmp_path / "steps"
    folder.mkdir()
    per_step = []
    for i, scale in enumerate(SCALES):
        recs = records(10 + i, scale)
        rows = layouts_with_train(recs)["verl"]
        for row in rows:
            row["reward"] = 1.0 - i / 10
        _jsonl(folder / f"step_{2 * i + 2}.jsonl", rows)
        infer = np.concatenate([r["logprobs"] for r in recs])
        train = np.concatenate([r["train"] for r in recs])
        per_step.append(token_metrics(infer, train, 0.2, 2.0))
    return folder, per_step


def test_a_many_step_folder_is_a_history_with_alarms(steps_folder, tmp_path):
    folder, per_step = steps_folder
    threshold = (per_step[1]["k3"] + per_step[2]["k3"]) / 2  # crossed first at the third step
    result = invoke("score", folder, "--alarm", f"k3>{threshold!r}", "--out", tmp_path / "h")
    assert result.exit_code == 0, result.output
    steps = pd.read_csv(tmp_path / "h" / "steps.csv")
    assert steps.step.tolist() == [0, 1, 2, 3, 4]
    assert steps.file.tolist() == [f"step_{2 * i + 2}.jsonl" for i in range(5)]
    assert steps.k3.tolist() == pytest.approx([m["k3"] for m in per_step], rel=1e-12)
    assert steps.reward_mean.tolist() == pytest.approx([1.0 - i / 10 for i in range(5)])
    alarms = pd.read_csv(tmp_path / "h" / "alarms.csv")
    assert alarms.set_index("metric").loc["k3", "first_step"] == 2
    assert {"steps.png", "steps.pdf"} <= {p.name for p in (tmp_path / "h").iterdir()}
    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert manifest["kind"] == "history" and manifest["history"]["n_steps"] == 5


def test_a_history_gate_fails_after_writing_everything(steps_folder, tmp_path):
    folder, per_step = steps_folder
    threshold = (per_step[2]["k3"] + per_step[3]["k3"]) / 2
    result = invoke("score", folder, "--fail-if", f"k3>{threshold!r}", "--out", tmp_path / "h")
    assert result.exit_code == 1, result.output
    assert f"gate failed: k3>{threshold!r} (step 3: {per_step[3]['k3']:.6g})" in result.output
    assert len(pd.read_csv(tmp_path / "h" / "steps.csv")) == 5
    gate = json.loads((tmp_path / "h" / "manifest.json").read_text())["gate"]
    assert gate["passed"] is False and gate["failed"][0]["where"] == "step 3"
    passing = invoke("score", folder, "--fail-if", f"k3>{per_step[-1]['k3'] * 2!r}", "--out", tmp_path / "ok")
    assert passing.exit_code == 0, passing.output


def test_an_unknown_history_metric_writes_nothing(steps_folder, tmp_path):
    folder, _ = steps_folder
    for flag in ("--fail-if", "--alarm"):
        result = invoke("score", folder, flag, "k4>1", "--out", tmp_path / "h")
        assert result.exit_code == 2 and "no metric 'k4'" in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
        assert not (tmp_path / "h").exists()


@pytest.mark.parametrize("flag, condition, named", [
    ("--alarm", "k3>nan", "not a finite number"),
    ("--fail-if", "k3>nan", "not a finite number"),
    ("--fail-if", "k3==1e-3x", "k3 is a number"),
    ("--fail-if", "untempered_mean_abs_dlogp>0.1", "add --temperature"),
    ("--fail-if", "tempered_mean_abs_dlogp>0.1", "add --model"),
    ("--alarm", "prefill_vs_train_mean_abs_dlogp>0.1", "add --infer vllm"),
    ("--fail-if", "mean_kl>0.1", "add --model"),  # the files hold both logprobs: no model, no logits, no KL
])
def test_a_history_condition_that_could_never_hold_writes_nothing(flag, condition, named, steps_folder, tmp_path):
    folder, _ = steps_folder
    result = invoke("score", folder, flag, condition, "--out", tmp_path / "h")
    assert result.exit_code == 2 and named in result.output and flag in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "h").exists()


def test_the_step_field_numbers_the_steps(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    for i, step in enumerate((100, 200)):
        rows = layouts_with_train(records(i, 0.1))["slime"]
        _jsonl(folder / f"{i}.jsonl", [row | {"step": step} for row in rows])
    result = invoke("score", folder, "--out", tmp_path / "h")
    assert result.exit_code == 0, result.output
    assert pd.read_csv(tmp_path / "h" / "steps.csv").step.tolist() == [100, 200]


def test_a_model_free_score_refuses_a_gate_on_the_kl_before_scoring(tmp_path, monkeypatch):
    import divergence_probe.runs.paired as paired

    path = _jsonl(tmp_path / "r.jsonl", layouts_with_train(records(3, 0.1))["trl"])
    monkeypatch.setattr(paired, "paired_run", lambda *a: pytest.fail("scored before the gate was checked"))
    result = invoke("score", path, "--fail-if", "max_kl>1", "--out", tmp_path / "f")
    assert result.exit_code == 2 and "this run will not measure max_kl; add --model" in result.output, result.output
    assert not (tmp_path / "f").exists()


def test_a_history_is_read_in_step_order_whatever_the_file_order(tmp_path):
    """Files whose names do not sort by step (hash-named dumps): steps.csv, the first crossing, the gate's step and
    the figure follow the `step` field, not the file order."""
    folder = tmp_path / "s"
    folder.mkdir()
    k3 = {}
    for name, step, scale in (("a", 30, 0.4), ("b", 10, 0.002), ("c", 20, 0.2)):  # the mismatch grows with the step
        recs = records(step, scale)
        _jsonl(folder / f"{name}.jsonl", [row | {"step": step} for row in layouts_with_train(recs)["slime"]])
        k3[step] = token_metrics(np.concatenate([r["logprobs"] for r in recs]),
                                 np.concatenate([r["train"] for r in recs]), 0.2, 2.0)["k3"]
    assert k3[10] < min(k3[20], k3[30])
    threshold = (k3[10] + min(k3[20], k3[30])) / 2  # first past it at step 20, though the file of step 30 comes first
    result = invoke("score", folder, "--alarm", f"k3>{threshold!r}", "--fail-if", f"k3>{threshold!r}",
                    "--out", tmp_path / "h")
    assert result.exit_code == 1, result.output
    steps = pd.read_csv(tmp_path / "h" / "steps.csv")
    assert steps.step.tolist() == [10, 20, 30] and steps.file.tolist() == ["b.jsonl", "c.jsonl", "a.jsonl"]
    assert steps.k3.tolist() == pytest.approx([k3[10], k3[20], k3[30]], rel=1e-12)
    assert pd.read_csv(tmp_path / "h" / "alarms.csv").set_index("metric").loc["k3", "first_step"] == 20
    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert manifest["gate"]["failed"][0]["where"] == "step 20" and "(step 20:" in result.output
    assert manifest["history"]["files_in_step_order"] is False
    assert manifest["files"]["steps.csv"]["rows"] == 3


def test_the_figure_draws_a_folder_of_unsorted_rows_in_step_order(tmp_path, monkeypatch):
    """A history folder written before steps.csv was sorted (rows in file order) is still drawn left to right."""
    import divergence_probe.reports.steps as steps_figure
    from divergence_probe.runs.history import Alarm, parse_alarms

    pd.DataFrame({"step": [30, 10, 20], "reward_mean": [0.1, 0.3, 0.2], "k3": [3e-3, 1e-3, 2e-3]}).to_csv(
        tmp_path / "steps.csv", index=False)
    drawn = {}
    monkeypatch.setattr(steps_figure, "save", lambda fig, folder, name: [])
    real = steps_figure.metrics_by_step
    monkeypatch.setattr(steps_figure, "metrics_by_step",
                        lambda step, steps, panels, reward: drawn.update(step=step.tolist(), k3=steps.k3.tolist())
                        or real(step, steps, panels, reward))
    steps_figure.draw_steps(tmp_path, [Alarm(c) for c in parse_alarms(["k3>1.5e-3"]).conditions])
    assert drawn == {"step": [10, 20, 30], "k3": [1e-3, 2e-3, 3e-3]}


def test_files_with_and_without_a_step_field_are_refused(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    for i in range(2):
        rows = layouts_with_train(records(i, 0.1))["slime"]
        _jsonl(folder / f"step_{i}.jsonl", [row | {"step": 5} for row in rows] if i else rows)
    result = invoke("score", folder, "--out", tmp_path / "h")
    assert result.exit_code == 2 and "records its step" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "h").exists()


def test_a_one_file_score_gate(tmp_path):
    path = _jsonl(tmp_path / "r.jsonl", layouts_with_train(records(3, 0.1))["trl"])
    failing = invoke("score", path, "--fail-if", "k3>0", "--fail-if", "likely_cause==stale_weights",
                     "--out", tmp_path / "f")
    assert failing.exit_code == 1 and "gate failed: k3>0" in failing.output, failing.output
    assert "likely_cause" not in failing.output.split("run:")[-1]  # a recording this close names no cause
    assert json.loads((tmp_path / "f" / "manifest.json").read_text())["gate"]["passed"] is False
    assert (tmp_path / "f" / "tokens.csv").is_file()
    passing = invoke("score", path, "--fail-if", "recorded_far==True", "--out", tmp_path / "p")
    assert passing.exit_code == 0, passing.output
    unknown = invoke("score", path, "--fail-if", "first_inexact!=none", "--out", tmp_path / "u")
    assert unknown.exit_code == 2 and not (tmp_path / "u").exists()


def test_a_history_with_a_model_scores_each_step_as_score_does(qwen3_tiny, tmp_path):
    """With --model the training stack scores every step, loaded once: each steps.csv row is score's summary of that
    file alone."""
    from divergence_probe.runs.history import parse_alarms, step_files
    from divergence_probe.runs.score import score, score_steps
    from divergence_probe.spec.score import ScoreSpec
    from divergence_probe.spec import LoadSpec

    folder = tmp_path / "s"
    folder.mkdir()
    for i in range(2):
        rows = layouts_with_train(records(20 + i, 0.1))["openrlhf"]
        _jsonl(folder / f"step_{i}.jsonl", rows)
    files = step_files([folder])
    load = LoadSpec(model=str(qwen3_tiny), dtype="float32")
    score_steps(files, tmp_path / "h", ScoreSpec(rollouts=str(files[0])), load, alarms=parse_alarms(None))
    steps = pd.read_csv(tmp_path / "h" / "steps.csv")
    for i, path in enumerate(files):
        alone = score(path, model=str(qwen3_tiny), dtype="float32").summary
        assert steps.loc[i, "mean_abs_dlogp"] == alone["mean_abs_dlogp"]
        assert steps.loc[i, "k3"] == alone["k3"]
    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert manifest["score"]["trainer"] == "scored" and manifest["model"]["config_sha256"]


def test_a_bad_step_file_writes_nothing(steps_folder, tmp_path):
    folder, _ = steps_folder
    (folder / "step_5.jsonl").write_text('{"prompts": [1], "responses": [2], "rollout_log_probs": [0.5]}\n')
    result = invoke("score", folder, "--out", tmp_path / "h")
    assert result.exit_code == 2 and "> 0" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "h").exists()


def test_a_full_disk_mid_history_rescues_every_step(steps_folder, tmp_path, monkeypatch):
    """No space left while steps.csv grows (its third row): one line naming the file, nothing left beside --out, and
    the history goes on into a rescue folder in the temp folder, the rows written before the error carried over:
    the same steps.csv a run with room writes, its alarms, figures and manifest."""
    import errno
    import tempfile

    import divergence_probe.runs.history as history
    from divergence_probe.run_folder import read_manifest

    folder, _ = steps_folder
    assert invoke("score", folder, "--out", tmp_path / "room").exit_code == 0
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    real = history.open_to_write

    class Full:
        """A file of the --out folder on a disk that fills at its third row."""

        def __init__(self, path, mode):
            self.file, self.rows = real(path, mode), 0

        def write(self, data):
            self.rows += bool(data)
            if self.rows == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

    monkeypatch.setattr(history, "open_to_write", lambda path, mode: (
        real(path, mode) if "divergence-probe-rescue-" in str(path) else Full(path, mode)))
    (tmp_path / "out").mkdir()
    result = invoke("score", folder, "--out", tmp_path / "out" / "h")
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert f"cannot write {tmp_path / 'out' / 'h' / 'steps.csv'} (No space left on device)" in line
    assert not any((tmp_path / "out").iterdir())
    (rescue,) = scratch.iterdir()
    assert f"saved to {rescue} instead" in line
    assert (rescue / "steps.csv").read_bytes() == (tmp_path / "room" / "steps.csv").read_bytes()
    assert {p.name for p in rescue.iterdir()} == {p.name for p in (tmp_path / "room").iterdir()}
    assert set(read_manifest(rescue)["files"]) == {"steps.csv", "alarms.csv", "steps.png", "steps.pdf"}


@pytest.mark.engine  # a child process (the suite's marker for those): a file-size limit is the process's own
def test_a_file_size_limit_on_a_history_is_one_line(steps_folder, tmp_path):
    """RLIMIT_FSIZE below the figures' size, everywhere (so the rescue fails as well): one line that says so, exit
    code 2, nothing left beside --out or in the temp folder."""
    import os
    import resource
    import subprocess
    import sys
    from pathlib import Path

    folder, _ = steps_folder
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / "out").mkdir()
    limit = 8000  # steps.csv fits, steps.png does not
    result = subprocess.run(
        [sys.executable, "-m", "divergence_probe", "score", str(folder), "--out", str(tmp_path / "out" / "h")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(scratch), "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: cannot write {tmp_path / 'out' / 'h'} (File too large)")
    assert "could not be saved elsewhere either (File too large)" in line
    assert not any((tmp_path / "out").iterdir()) and not any(scratch.iterdir())
