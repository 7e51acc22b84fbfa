"""The report's remedies section (a remedies run folder's remedies.csv): the ranking in words, each paired comparison
(an arm against the one it is paired with, on the same bootstrap draws), then the table of every arm's change with its
interval and floor, what it needs and what it costs on each side."""

from __future__ import annotations

import pandas as pd

from ..numerics.remedies import NO_INTERVAL_WHY, NOT_RUN, ranking_lines
from ..numerics.shapley import ADDS, NO_INTERVAL, REMOVES, effect
from .document import Bullets, Column, Heading, Paragraph, Table
from .run_data import RunData
from .wording import _code, _finite, _signed, interval

# remedies.csv's columns the report shows, in this order (the CSV has every side's spread and peak memory too)
SHOWN = (("arm", "code"), ("needs", "text"), ("status", "code"), ("share", "pct"), ("share_ci_low", "pct"),
         ("share_ci_high", "pct"), ("effect", "code"), ("mismatch_over_floor", "num"), ("floor", "text"),
         ("effect_rank", "int"), ("train_forward_added_s", "num"), ("train_forward_backward_added_s", "num"),
         ("engine_step_added_s", "num"), ("train_forward_backward_peak_added_bytes", "num"), ("cost_rank", "int"))


def paired_lines(table: pd.DataFrame, metric: str, level: str, code=_code) -> list[str]:
    """Each paired arm against its pair: the difference of the metric (the arm's minus its pair's) with its interval,
    and what the interval says of it; a paired arm not run, why. No line for a folder from before the pairs. `code`
    marks names (the terminal's lines take them plain)."""
    if "paired_with" not in table:
        return []
    lines = []
    for row in table[table["paired_with"].notna()].itertuples():
        arm, pair = code(row.arm), code(row.paired_with)
        head = f"{arm} against {pair}"
        if row.status == NOT_RUN:
            lines.append(f"{head}: not run: {row.reason}")
            continue
        if not _finite(row.paired_change):
            lines.append(f"{head}: no difference to state, {pair} did not run")
            continue
        low, high = row.paired_ci_low, row.paired_ci_high
        found = effect(float(low), float(high))
        difference = f"{head}: {code(metric)} {_signed(row.paired_change)}"
        if found == NO_INTERVAL:
            lines.append(f"{difference}, {NO_INTERVAL_WHY}")
            continue
        verdict = {REMOVES: f"{arm} leaves less mismatch than {pair}",
                   ADDS: f"{arm} leaves more mismatch than {pair}"}.get(found, "no detectable difference")
        lines.append(f"{difference} ({interval(low, high, level)}): {verdict}; tests: {row.claim}")
    return lines


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
    paired = paired_lines(table, metric, run.ci_level)
    comparisons = [Paragraph(f"Paired comparisons: each arm against the one it is paired with, on the same bootstrap "
                             f"draws of prompts: the arm's `{metric}` minus its pair's (below 0: the arm leaves less "
                             "mismatch)."), Bullets(tuple(paired))] if paired else []
    return [Heading("What to change: remedies ranked"),
            Bullets(tuple(ranking_lines(table, metric))),
            *comparisons,
            Table("remedies", caption, tuple(Column(c, kind) for c, kind in shown), rows)]
