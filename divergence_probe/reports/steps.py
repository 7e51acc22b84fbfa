"""A run's history drawn (score over many steps, runs/history.py): steps.png/.pdf beside steps.csv."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .figures import metrics_by_step, save

FIGURE = "steps"


def draw_steps(folder: Path, alarms: list) -> list[str]:
    """steps.png/.pdf, read back from folder/steps.csv (only the plotted columns come into memory): one panel per
    alarm (history.Alarm) whose metric is a number, the mean reward beside the first when recorded."""
    panels = [(a.condition.metric, float(a.condition.value), a.first_step) for a in alarms]
    wanted = ["step", "reward_mean", *dict.fromkeys(metric for metric, _, _ in panels)]
    steps = pd.read_csv(folder / "steps.csv", usecols=lambda c: c in wanted)
    return [p.name for p in save(steps_figure(steps, panels), folder, FIGURE)]


def steps_figure(steps: pd.DataFrame, panels: list[tuple[str, float, int | None]]):
    """The history's figure from steps.csv's rows and (metric, threshold, first step past it) per alarm: a panel per
    alarm whose metric is a number, the mean reward beside the first when recorded (the run's and its report's)."""
    # in step order: a folder written before steps.csv was sorted may hold its rows in file order (a zigzag)
    steps = steps.sort_values("step", kind="stable")
    panels = [p for p in panels if p[0] in steps and pd.api.types.is_numeric_dtype(steps[p[0]])]
    reward = steps["reward_mean"] if steps["reward_mean"].notna().any() else None
    return metrics_by_step(steps["step"], steps, panels, reward)
