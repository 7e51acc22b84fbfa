"""Is the mismatch more than noise? The mismatch between the stacks (mean |Δlogp|) over the largest noise floor the
run measured, with a bootstrap interval over prompts, and a verdict worded from that interval, not from the point
ratio: a ratio of 1.1 on a handful of prompts says nothing a ratio of 0.9 would not.

The interval resamples the prompts of the mismatch (shapley.bootstrap, the ablation's resampling); the floor is held
at its measured value, so the interval is the mismatch's prompt-to-prompt uncertainty against that floor.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .shapley import bootstrap, per_prompt
from .tables import largest_noise_floor

DRAWS = 1000  # bootstrap resamples of prompts
LEVEL = 0.95
RATIO = "mismatch_over_floor"  # summary.csv: mean_abs_dlogp / the largest noise floor
VERDICT = "noise_verdict"
ABOVE, WITHIN, CANNOT_TELL = "above_floor", "within_floor", "cannot_tell"


def verdict(low: float, high: float) -> str:
    """above_floor when the whole interval is above 1, within_floor when the whole of it is at or below 1."""
    if low > 1:
        return ABOVE
    if high <= 1:
        return WITHIN
    return CANNOT_TELL


def floor_columns(tokens: pd.DataFrame, summary: dict, seed: int) -> dict:
    """summary.csv's ratio, its interval and the verdict; nothing when no floor was measured. A floor of exactly 0
    has no ratio: any mismatch is above it, none is within it."""
    largest = largest_noise_floor(summary)
    if largest is None:
        return {}
    floor, mismatch = largest[1], float(summary["mean_abs_dlogp"])
    if floor == 0:
        nan = float("nan")
        return {RATIO: nan, RATIO + "_ci_low": nan, RATIO + "_ci_high": nan,
                VERDICT: ABOVE if mismatch > 0 else WITHIN}
    p = per_prompt(tokens)
    sums, counts = p["sum_abs_dlogp"].to_numpy(np.float64), p["n"].to_numpy(np.float64)
    low, high = bootstrap(len(p), lambda w: {RATIO: float(w @ sums / (w @ counts)) / floor}, DRAWS, seed,
                          LEVEL)[RATIO]
    return {RATIO: mismatch / floor, RATIO + "_ci_low": low, RATIO + "_ci_high": high, VERDICT: verdict(low, high)}


def manifest_record(summary: dict) -> dict:
    """The manifest's `noise_verdict`: the same numbers as summary.csv, with the floor they are against."""
    if VERDICT not in summary:
        return {}
    name, floor = largest_noise_floor(summary)

    def number(key: str) -> float | None:  # no ratio over a floor of 0: null, not NaN, in JSON
        value = float(summary[key])
        return None if value != value else value

    return {"noise_verdict": {"verdict": summary[VERDICT], "ratio": number(RATIO),
                              "ci": [number(RATIO + "_ci_low"), number(RATIO + "_ci_high")], "level": LEVEL,
                              "draws": DRAWS, "floor": name, "floor_mean_abs_dlogp": floor}}


def in_words(summary) -> str | None:
    """The verdict as a user reads it, with what would settle a `cannot_tell`; None without a floor."""
    v = summary.get(VERDICT)
    if v is None or (isinstance(v, float) and v != v):
        return None
    ratio, low, high = (float(summary.get(k, float("nan"))) for k in (RATIO, RATIO + "_ci_low", RATIO + "_ci_high"))
    if ratio != ratio:  # a floor of exactly 0: no ratio
        return ("above the noise floor: the largest noise floor is exactly 0 and the mismatch is not" if v == ABOVE
                else "within the noise floor: the mismatch and the largest noise floor are both exactly 0")
    span = (f"{ratio:.3g}x its largest noise floor ({LEVEL:.0%} interval over prompts {low:.3g}x to {high:.3g}x)")
    return {ABOVE: f"above the noise floor: the mismatch is {span}",
            WITHIN: f"within the noise floor: the mismatch is {span}",
            CANNOT_TELL: f"cannot tell from noise: the mismatch is {span}, an interval that straddles 1; more "
                         "prompts (--num-prompts, a larger --prompts file) would narrow it"}[v]
