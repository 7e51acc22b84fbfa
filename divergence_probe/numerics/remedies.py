"""The remedies table's reading, apart from the runs that fill it (runs/remedies.py) so that a report reads it too:
which arms are ranked (those whose whole interval removes mismatch), in which order by effect and by cost, and the
words that say so. Pure pandas.
"""

from __future__ import annotations

import pandas as pd

from .shapley import ADDS, NO_INTERVAL, NOT_DETECTED, REMOVES

RAN, NOT_RUN = "run", "not_run"  # remedies.csv `status`
# why a change has no interval, in the words of the ranking and of the report
NO_INTERVAL_WHY = "no interval (fewer prompts than a bootstrap needs, or --bootstrap 0)"


def ranked(table: pd.DataFrame) -> pd.DataFrame:
    """effect_rank (1: removes the most) and cost_rank (1: adds the least time to a step: the trainer's forward and
    forward+backward and the engine's step together) over the arms whose whole interval removes mismatch; every other
    arm (no detectable effect, one that adds mismatch, no interval, not run) is not ranked."""
    table = table.copy()
    table["effect_rank"] = table["cost_rank"] = pd.NA
    if "effect" not in table:
        return table
    found = table[table["effect"] == REMOVES]
    table.loc[found.sort_values("change", kind="stable").index, "effect_rank"] = range(1, len(found) + 1)
    table.loc[found.sort_values("step_added_s", kind="stable").index, "cost_rank"] = range(1, len(found) + 1)
    table["effect_rank"] = table["effect_rank"].astype("Int64")
    table["cost_rank"] = table["cost_rank"].astype("Int64")
    return table


def ranking_lines(table: pd.DataFrame, metric: str) -> list[str]:
    """The ranking in words: each detectable remedy by effect with its interval and cost; then the arms with no
    detectable effect, those that add mismatch, and those not run, each with why. With none ranked: that none removes
    a detectable part, or, where none ran (every one failed on the loaded stacks), that none ran."""
    lines = []
    ranked_rows = table[table["effect_rank"].notna()].sort_values("effect_rank") if "effect_rank" in table else table[:0]
    for row in ranked_rows.itertuples():
        lines.append(f"{int(row.effect_rank)}. {row.arm} ({row.needs}): {metric} {100 * row.share:+.3g}% "
                     f"[{100 * row.share_ci_low:+.3g}%, {100 * row.share_ci_high:+.3g}%], now "
                     f"{row.mismatch_over_floor:.3g}x its floor; adds {_seconds(row.step_added_s)} a step "
                     f"(cost rank {int(row.cost_rank)}); tests: {row.claim}")
    if not len(ranked_rows):
        ran = (table["status"] == RAN).any()
        lines.append(f"No arm removes a detectable part of the {metric}." if ran else "No arm ran, so none is ranked.")
    for kind, words in ((NOT_DETECTED, "no detectable effect"), (ADDS, "adds mismatch"), (NO_INTERVAL, NO_INTERVAL_WHY)):
        names = table[table["effect"] == kind]["arm"].tolist() if "effect" in table else []
        if names:
            lines.append(f"{words}: {', '.join(names)}")
    for row in table[table["status"] == NOT_RUN].itertuples():
        lines.append(f"not run: {row.arm}: {row.reason}")
    return lines


def _seconds(value: float) -> str:
    return "n/a" if value != value else f"{value * 1e3:+.3g} ms"
