"""A run's history drawn (score over many steps, runs/history.py): steps.png/.pdf beside steps.csv."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .figures import metrics_by_step, save

FIGURE = "steps"


def draw_steps(folder: Path, alarms: list) -> list[str]:
    """steps.png/.pdf, read back from folder/steps.csv (only the plotted columns come into memory): one panel per
    alarm (history.Alarm) whose metric is a number, the mean reward beside the first when recorded."""
    wanted = ["step", "reward_mean", *dict.fromkeys(a.condition.metric for a in alarms)]
    # in step order: a folder written before steps.csv was sorted may hold its rows in file order (a zigzag)
    steps = pd.read_csv(folder / "steps.csv", usecols=lambda c: c in wanted).sort_values("step", kind="stable")
    panels = [(a.condition.metric, float(a.condition.value), a.first_step) for a in alarms
              if a.condition.metric in steps and pd.api.types.is_numeric_dtype(steps[a.condition.metric])]
    reward = steps["reward_mean"] if steps["reward_mean"].notna().any() else None
    return [p.name for p in save(metrics_by_step(steps["step"], steps, panels, reward), folder, FIGURE)]
