"""`report` renders any run folder, a run's history (score over many files) too: its alarms, its figure and a row
per step, from the files the history wrote (checked against its manifest). No model: synthetic rollouts that record
both logprob columns (tests/runs/test_history.py)."""

from __future__ import annotations

import shutil

import pandas as pd

from test_history import invoke, steps_folder  # noqa: F401  (steps_folder: a fixture)


def test_report_renders_a_history_run_and_refuses_a_changed_one(steps_folder, tmp_path):  # noqa: F811
    folder, per_step = steps_folder
    threshold = (per_step[1]["k3"] + per_step[2]["k3"]) / 2  # crossed first at the third step
    assert invoke("score", folder, "--alarm", f"k3>{threshold!r}", "--out", tmp_path / "h").exit_code == 0
    result = invoke("report", tmp_path / "h", "--out", tmp_path / "r")
    assert result.exit_code == 0, result.output
    text = (tmp_path / "r" / "report.md").read_text()
    steps = pd.read_csv(tmp_path / "h" / "steps.csv")
    assert "first at step 2" in text
    assert all(f"`{name}`" in text for name in steps.file)
    assert (tmp_path / "r" / "figures" / "steps.png").is_file()

    changed = tmp_path / "changed"
    shutil.copytree(tmp_path / "h", changed)
    with (changed / "steps.csv").open("a") as f:
        f.write("9,extra.jsonl\n")
    result = invoke("report", changed, "--out", tmp_path / "r2")
    assert result.exit_code == 2 and "steps.csv" in result.output and "sha256" in result.output
    assert not (tmp_path / "r2").exists()
