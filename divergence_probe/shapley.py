"""Shapley attribution for ablations: subsets, exact Shapley values, and bootstrap intervals over prompts.

No model code here. The value of a set S of aligned regions is the *reduction* of the mismatch metric:
v(S) = m(∅) - m(S). Shapley values split v(all) exactly among regions (efficiency), crediting
interactions fairly; the main effect is v({r}), the leave-one-out loss is v(all) - v(all \\ {r}).
"""

from __future__ import annotations

from itertools import combinations
from math import factorial
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

Combo = frozenset
SHIPPED = "none"  # the combination with no region aligned
REMAINING = "(remaining)"  # attribution row: what is left with every region aligned (not a region)

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


def attribution(metric_of: Mapping[Combo, float], regions: Sequence[str]) -> pd.DataFrame:
    """One row per region (shapley, share, main_effect, leave_one_out) from the metric of every combo."""
    none, everything = Combo(), Combo(regions)
    reduction = {c: metric_of[none] - m for c, m in metric_of.items()}
    phi = shapley(reduction, regions)
    total = reduction[everything]
    rows = [{
        "region": r,
        "shapley": phi[r],
        "share": phi[r] / total if total else float("nan"),
        "main_effect": reduction[Combo({r})],
        "leave_one_out": total - reduction[everything - {r}],
    } for r in regions]
    return pd.DataFrame(rows)


def bootstrap_intervals(per_combo: Mapping[Combo, pd.DataFrame], regions: Sequence[str], metric: str,
                        n_boot: int, seed: int, level: float = 0.95) -> dict[str, tuple[float, float]]:
    """Percentile intervals of each region's Shapley value, resampling prompts with replacement.

    Returns also the interval of the metric that remains with every region aligned, under key "remaining".
    """
    fn = METRICS[metric]
    n_prompts = len(next(iter(per_combo.values())))
    rng = np.random.default_rng(seed)
    draws = {r: [] for r in regions} | {"remaining": []}
    for _ in range(n_boot):
        weights = np.bincount(rng.integers(0, n_prompts, n_prompts), minlength=n_prompts)
        metric_of = {c: fn(p, weights) for c, p in per_combo.items()}
        phi = shapley({c: metric_of[Combo()] - m for c, m in metric_of.items()}, regions)
        for r in regions:
            draws[r].append(phi[r])
        draws["remaining"].append(metric_of[Combo(regions)])
    lo, hi = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    return {k: (float(np.percentile(v, lo)), float(np.percentile(v, hi))) if v else (float("nan"), float("nan"))
            for k, v in draws.items()}
