"""The report's remedies section (a remedies run folder's remedies.csv): the ranking in words, then the table of every
arm's change with its interval and floor, what it needs and what it costs on each side."""

from __future__ import annotations

import pandas as pd

from ..numerics.remedies import ranking_lines
from .document import Bullets, Column, Heading, Table
from .run_data import RunData

# remedies.csv's columns the report shows, in this order (the CSV has every side's spread and peak memory too)
SHOWN = (("arm", "code"), ("needs", "text"), ("status", "code"), ("share", "pct"), ("share_ci_low", "pct"),
         ("share_ci_high", "pct"), ("effect", "code"), ("mismatch_over_floor", "num"), ("floor", "text"),
         ("effect_rank", "int"), ("train_forward_added_s", "num"), ("train_forward_backward_added_s", "num"),
         ("engine_step_added_s", "num"), ("train_forward_backward_peak_added_bytes", "num"), ("cost_rank", "int"))


def remedies_section(run: RunData) -> list:
    table = run.extra.get("remedies")
    if table is None:
        return []
    metric = run.manifest.get("remedies", {}).get("metric", "mean_abs_dlogp")
    shown = [(c, kind) for c, kind in SHOWN if c in table]
    rows = tuple(tuple(None if pd.isna(v) else v for v in row)
                 for row in table[[c for c, _ in shown]].itertuples(index=False, name=None))
    caption = (f"Each arm against the stacks as shipped on the same prompts (remedies.csv): its change of `{metric}` "
               "as a share of the shipped value with its paired bootstrap interval, the arm's mismatch over its own "
               "largest noise floor, and the seconds it adds to each side's step (medians over repeats; the spreads "
               "and peak memory are in the CSV). Only arms whose whole interval removes mismatch are ranked.")
    return [Heading("What to change: remedies ranked"),
            Bullets(tuple(ranking_lines(table, metric))),
            Table("remedies", caption, tuple(Column(c, kind) for c, kind in shown), rows)]
