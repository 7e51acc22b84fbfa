"""Shapley attribution for ablations: subsets, exact Shapley values, and bootstrap intervals over prompts.

No model code here. The value of a set S of aligned regions is the *change* of the mismatch metric it makes:
v(S) = m(S) - m(∅), negative when aligning S removes mismatch and positive when it adds some. Shapley values split
v(all) exactly among regions (efficiency), crediting interactions fairly; the main effect is v({r}), the
leave-one-out change is v(all) - v(all \\ {r}). Each is also given as a share of the shipped metric m(∅): a share
of the total change would flip sign whenever aligning everything makes the mismatch worse, so a region that helps
would read as a negative share beside one that hurts as a positive one.
"""

from __future__ import annotations

from itertools import combinations
from math import factorial
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

Combo = frozenset
SHIPPED = "none"  # the combination with no region aligned
ALL_REGIONS = "(all regions)"  # attribution row: the change of aligning every region at once (not a region)
CHANGE = "shapley_change"  # a region's Shapley value of v: negative = removes mismatch, positive = adds it
SHARE = "shapley_change_share_of_shipped"  # CHANGE / m(∅), same sign convention

# The fewest prompts a bootstrap interval is given on, here and in the noise verdict (noise_verdict.py): a percentile
# bootstrap over n prompts covers less than its level when n is small (with one prompt every draw is that prompt and
# the interval has width 0); the docs (reference, "How many prompts") give the rule and what it rests on.
MIN_PROMPTS = 20
# attribution.csv's `effect`: what the interval of a change says, not its point value.
REMOVES, ADDS, NOT_DETECTED, NO_INTERVAL = "removes", "adds", "no_detectable_effect", "no_interval"
EFFECT = "effect"
# attribution.csv: the same attribution under the other metric of the pair, so that a sign that depends on the metric
# is printed, not found by rerunning.
OTHER_METRIC = {"mean_kl": "mean_abs_dlogp", "mean_abs_dlogp": "mean_kl", "max_kl": "max_abs_dlogp",
                "max_abs_dlogp": "max_kl"}
DISAGREE = "metrics_disagree_in_sign"  # attribution.csv: the share and other_metric_share point opposite ways

# Metrics that can be recomputed from per-prompt sums, so bootstrap resampling of prompts is exact.
METRICS: dict[str, Callable[[pd.DataFrame, np.ndarray], float]] = {
    "mean_kl": lambda p, w: float((w * p["sum_kl"]).sum() / (w * p["n"]).sum()),
    "mean_abs_dlogp": lambda p, w: float((w * p["sum_abs_dlogp"]).sum() / (w * p["n"]).sum()),
    "max_kl": lambda p, w: float(p["max_kl"][w > 0].max()),
    "max_abs_dlogp": lambda p, w: float(p["max_abs_dlogp"][w > 0].max()),
}


def subsets(regions: Sequence[str]) -> list[Combo]:
    """All 2^k subsets, smallest first, each size in the given region order."""
    return [Combo(c) for size in range(len(regions) + 1) for c in combinations(regions, size)]


def combo_name(combo: Combo, order: Sequence[str]) -> str:
    return "+".join(r for r in order if r in combo) or SHIPPED


def per_prompt(tokens: pd.DataFrame) -> pd.DataFrame:
    """Per-prompt sums and maxima of a tokens table (sorted by prompt_id); response tokens in generate mode."""
    if "is_response" in tokens:
        tokens = tokens[tokens["is_response"]]
    t = tokens.assign(abs_dlogp=tokens["delta_logprob"].abs())
    g = t.groupby("prompt_id", sort=True)
    return pd.DataFrame({
        "n": g.size(),
        "sum_kl": g["kl"].sum(),
        "sum_abs_dlogp": g["abs_dlogp"].sum(),
        "max_kl": g["kl"].max(),
        "max_abs_dlogp": g["abs_dlogp"].max(),
    })


def shapley(value: Mapping[Combo, float], players: Sequence[str]) -> dict[str, float]:
    """Exact Shapley values of a game given on every subset of players."""
    n = len(players)
    phi = {}
    for p in players:
        others = [q for q in players if q != p]
        total = 0.0
        for size in range(n):
            weight = factorial(size) * factorial(n - size - 1) / factorial(n)
            for s in combinations(others, size):
                total += weight * (value[Combo(s) | {p}] - value[Combo(s)])
        phi[p] = total
    return phi


def change_words(share: float) -> str:
    """A signed share of the shipped metric in words: "removes 24.7%" / "adds 89.2%" / "changes nothing"."""
    if share != share:
        return "n/a"
    if share == 0:
        return "changes nothing"
    return f"{'removes' if share < 0 else 'adds'} {abs(100 * share):.3g}%"


def effect(low: float, high: float) -> str:
    """removes / adds when the whole interval of a change is below / above 0, no_detectable_effect when it holds 0,
    no_interval when there is none (--bootstrap 0, fewer than MIN_PROMPTS prompts)."""
    if not (low == low and high == high):
        return NO_INTERVAL
    return REMOVES if high < 0 else ADDS if low > 0 else NOT_DETECTED


def effect_words(share: float, low: float, high: float, level: str = "95%") -> str:
    """A share of the shipped metric in words that follow its interval (shares, same sign convention): "removes
    24.7%", "no detectable effect (point -6.51%, 95% interval -20% to +7%)", "removes 6.51% (no interval)"."""
    kind = effect(low, high)
    if share != share:  # a shipped metric of 0: no share to word
        return change_words(share)
    if kind == NO_INTERVAL:
        return f"{change_words(share)} (no interval)"
    if kind == NOT_DETECTED:
        return (f"no detectable effect (point {100 * share:+.3g}%, {level} interval {100 * low:+.3g}% to "
                f"{100 * high:+.3g}%)")
    return change_words(share)


def disagree(share: float, other: float) -> bool:
    """Whether two metrics' shares of one region point opposite ways (one removes mismatch, the other adds it)."""
    return bool(share * other < 0)


def _changes(metric_of: Mapping[Combo, float], regions: Sequence[str]) -> dict[str, float]:
    """Each region's Shapley value of v and, under ALL_REGIONS, v(all)."""
    none = metric_of[Combo()]
    phi = shapley({c: m - none for c, m in metric_of.items()}, regions)
    return phi | {ALL_REGIONS: metric_of[Combo(regions)] - none}


def attribution(metric_of: Mapping[Combo, float], regions: Sequence[str]) -> pd.DataFrame:
    """One row per region and a last ALL_REGIONS row: CHANGE, SHARE (of the shipped metric), main_effect_change and
    leave_one_out_change (regions only) from the metric of every combo."""
    none, everything = Combo(), Combo(regions)
    shipped = metric_of[none]
    change = {c: m - shipped for c, m in metric_of.items()}
    values = _changes(metric_of, regions)
    return pd.DataFrame([{
        "region": r,
        CHANGE: values[r],
        SHARE: values[r] / shipped if shipped else float("nan"),
        "main_effect_change": change[Combo({r})] if r != ALL_REGIONS else float("nan"),
        "leave_one_out_change": change[everything] - change[everything - {r}] if r != ALL_REGIONS else float("nan"),
    } for r in (*regions, ALL_REGIONS)])


def bootstrap(n_prompts: int, statistics: Callable[[np.ndarray], Mapping[str, float]], n_boot: int, seed: int,
              level: float = 0.95) -> dict[str, tuple[float, float]]:
    """Percentile intervals of named statistics of prompt weights (how often each prompt is drawn), resampling
    prompts with replacement; a statistic that is NaN in a draw (a zero denominator) is left out of that draw. Below
    MIN_PROMPTS prompts every interval is NaN: too few prompts to give one."""
    if n_prompts < MIN_PROMPTS:
        return {k: (float("nan"), float("nan")) for k in statistics(np.ones(n_prompts))}
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {}
    for _ in range(n_boot):
        weights = np.bincount(rng.integers(0, n_prompts, n_prompts), minlength=n_prompts)
        for name, value in statistics(weights).items():
            draws.setdefault(name, [])
            if value == value:
                draws[name].append(value)
    lo, hi = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    return {k: (float(np.percentile(v, lo)), float(np.percentile(v, hi))) if v else (float("nan"), float("nan"))
            for k, v in draws.items()}


def bootstrap_intervals(per_combo: Mapping[Combo, pd.DataFrame], regions: Sequence[str], metric: str,
                        n_boot: int, seed: int, level: float = 0.95) -> dict[str, tuple[float, float]]:
    """Percentile intervals of each region's CHANGE (key: the region) and SHARE (key: region + "/share"), and of
    v(all) and its share under ALL_REGIONS, resampling prompts with replacement."""
    fn = METRICS[metric]
    n_prompts = len(next(iter(per_combo.values())))

    def statistics(weights: np.ndarray) -> dict[str, float]:
        metric_of = {c: fn(p, weights) for c, p in per_combo.items()}
        shipped = metric_of[Combo()]
        values = _changes(metric_of, regions)
        return values | {k + "/share": v / shipped if shipped else float("nan") for k, v in values.items()}

    return bootstrap(n_prompts, statistics, n_boot, seed, level)


def attribution_lines(rows: Sequence[Mapping], metric: str, factors: bool = False, level: str = "95%") -> list[str]:
    """The sentences under the attribution table (attribution.csv rows, ALL_REGIONS last): what aligning everything
    does, worded from its interval; the regions with a detectable effect, largest first (none when none is); and each
    region whose share points the other way under the other metric."""
    *regions, total = rows
    everything = "Aligning every region and setting every factor" if factors else "Aligning every region"
    lines = [f"{everything}: {effect_words(total[SHARE], total['share_ci_low'], total['share_ci_high'], level)} "
             f"of the shipped {metric}."]
    found = sorted((r for r in regions if r.get(EFFECT) in (REMOVES, ADDS)), key=lambda r: -abs(r[CHANGE]))
    if found:
        lines.append("Detectable, largest first: " + "; ".join(
            f"{r['region']} {change_words(r[SHARE])}" if r[SHARE] == r[SHARE]  # else a shipped metric of 0
            else f"{r['region']} {'removes' if r[CHANGE] < 0 else 'adds'} {abs(r[CHANGE]):.3g}" for r in found) + ".")
    elif any(r.get(EFFECT) == NOT_DETECTED for r in regions):
        lines.append(f"No region has a detectable effect on {metric}: every interval holds 0.")
    elif regions:
        lines.append(f"No region's effect was tested: no interval (--bootstrap 0, or fewer than {MIN_PROMPTS} "
                     "prompts).")
    for r in rows:
        if r.get(DISAGREE) in (True, "True"):
            lines.append(f"{r['region']}: {metric} and {r['other_metric']} disagree in sign "
                         f"({100 * r[SHARE]:+.3g}% vs {100 * r['other_metric_share']:+.3g}% of shipped): whether it "
                         "removes mismatch depends on the metric.")
    return lines
