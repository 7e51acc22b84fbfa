"""rl_summary.csv: one line per (setting, seed) of an rl run, the reward and the mismatch at its start and its end,
read by the rl command, its run folder and its report alike."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pandas as pd

from .collapse import collapsed_at_step

FLOORS = ("floor_engine_batch", "floor_train_batch")
WINDOW = 10  # the most steps averaged at the start and at the end of a run in rl_summary.csv


def window(steps: int) -> int:
    """Steps averaged at each end of a run of `steps` steps: at most WINDOW, and at most half the run, so that the
    start and the end never share a step (a run of 12 steps compares steps 1-6 with 7-12, not 1-10 with 3-12,
    which would hide a fall in the reward behind the eight steps both averages hold). A run of one step has one."""
    return max(1, min(WINDOW, steps // 2))


def window_label(first: int, last: int, width: int) -> str:
    """'steps 1-5 -> steps 16-20': which steps the start and end columns of rl_summary.csv average."""
    span = lambda a, b: f"step {a}" if a == b else f"steps {a}-{b}"  # noqa: E731
    return f"{span(first, first + width - 1)} -> {span(last - width + 1, last)}"


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (setting, seed): reward and mismatch at the start and the end (the means over the first and the
    last `window` steps, which never overlap: `window`), and the loop's cost."""
    out = []
    for (setting, seed), run in rows.groupby(["setting", "seed"], sort=False):
        width = window(len(run))
        head, tail = run.head(width), run.tail(width)
        work = run[["t_rollout", "t_reward", "t_update"]].sum(axis=1)
        loop = run[["t_metrics", "t_sync", "t_check"]].sum(axis=1)
        out.append({
            "setting": setting, "seed": seed, "steps": len(run), "window": width,
            "reward_start": head.reward_mean.mean(), "reward_end": tail.reward_mean.mean(),
            "reward_max": run.reward_mean.max(),
            "mean_abs_dlogp_start": head.mean_abs_dlogp.mean(), "mean_abs_dlogp_end": tail.mean_abs_dlogp.mean(),
            "k3_end": tail.k3.mean(), "ppo_clip_frac_end": tail.ppo_clip_frac.mean(),
            "entropy_start": head.entropy.mean(), "entropy_end": tail.entropy.mean(),
            "grad_norm_max": run.grad_norm.max(),
            # each stack against itself, alone against batched, at the first step (rl/loop.py start_floors)
            **{f: run[f].iloc[0] for f in FLOORS if f in run},
            "collapsed_at_step": collapsed_at_step(run, width),
            "s_per_step": (work + loop).mean(), "overhead_frac": loop.sum() / work.sum(),
        })
    table = pd.DataFrame(out)
    if len(table):
        table["collapsed_at_step"] = table["collapsed_at_step"].astype("Int64")  # empty where none
    return with_comparison(table)


# Settings against each other: each setting's end reward against the first setting's, over seeds. A run's seed is
# the only replicate, so the spread between seeds is the uncertainty; with one seed a setting has none to measure.
LEVEL = 0.95
MIN_SEEDS = 2  # per setting: the fewest with which seed-to-seed spread can be estimated at all
MOST_SEEDS = 1000  # seeds_needed stops counting here
VS, DIFF, DIFF_VERDICT, SEEDS_NEEDED = "vs_setting", "reward_end_diff", "reward_end_diff_verdict", "seeds_needed"
DIFFERS, NOT_DETECTED, TOO_FEW_SEEDS = "differs", "no_detectable_difference", "too_few_seeds"


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile for p in (0.5, 1): the CDF integrated from 0 (Simpson's rule on the density) and
    inverted by bisection; df need not be whole (Welch)."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:
        t = np.linspace(0.0, x, 2001)
        f = np.exp(log_norm - (df + 1) / 2 * np.log1p(t * t / df))
        return 0.5 + (x / 6000) * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    low, high = 0.0, 1.0
    while cdf(high) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def difference(a: np.ndarray, b: np.ndarray, level: float = LEVEL) -> tuple[float, float, float]:
    """mean(a) − mean(b) and its Welch t interval over seeds; NaN bounds when either has fewer than MIN_SEEDS."""
    d = float(a.mean() - b.mean())
    if min(len(a), len(b)) < MIN_SEEDS:
        return d, float("nan"), float("nan")
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return d, d, d
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t_quantile((1 + level) / 2, df) * se
    return d, d - half, d + half


def seeds_needed(a: np.ndarray, b: np.ndarray, level: float = LEVEL) -> float:
    """Seeds per setting with which the interval of a difference as large as the one measured, at the seeds' pooled
    spread, would leave out 0 (a plan, not a promise: the next seeds move both); NaN without a spread or a
    difference, MOST_SEEDS when even that many would not do."""
    d = abs(float(a.mean() - b.mean()))
    if min(len(a), len(b)) < MIN_SEEDS or d == 0:
        return float("nan")
    sd = math.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2)
    if sd == 0:
        return float(MIN_SEEDS)
    z = NormalDist().inv_cdf((1 + level) / 2)  # t > z: no fewer seeds than the normal approximation needs
    for n in range(max(MIN_SEEDS, min(MOST_SEEDS, math.floor(2 * (z * sd / d) ** 2))), MOST_SEEDS):
        if t_quantile((1 + level) / 2, 2 * n - 2) * sd * math.sqrt(2 / n) < d:
            return float(n)
    return float(MOST_SEEDS)


def with_comparison(table: pd.DataFrame) -> pd.DataFrame:
    """rl_summary.csv's comparison columns: on each row of a setting after the first, that setting's end reward
    (mean over its seeds) minus the first setting's, its interval over seeds, the verdict the interval gives and the
    seeds per setting a difference that large would need; empty on the first setting's rows."""
    nan = float("nan")
    columns = {VS: "", DIFF: nan, DIFF + "_ci_low": nan, DIFF + "_ci_high": nan, DIFF_VERDICT: "", SEEDS_NEEDED: nan}
    table = table.assign(**columns)
    settings = list(dict.fromkeys(table["setting"])) if len(table) else []
    if len(settings) < 2:
        return table.astype({SEEDS_NEEDED: "Int64"})
    base = table.loc[table["setting"] == settings[0], "reward_end"].to_numpy(np.float64)
    for setting in settings[1:]:
        rows = table["setting"] == setting
        mine = table.loc[rows, "reward_end"].to_numpy(np.float64)
        d, low, high = difference(mine, base)
        verdict = TOO_FEW_SEEDS if low != low else DIFFERS if low > 0 or high < 0 else NOT_DETECTED
        table.loc[rows, list(columns)] = [settings[0], d, low, high, verdict, seeds_needed(mine, base)]
    return table.astype({SEEDS_NEEDED: "Int64"})


def comparison_words(table: pd.DataFrame) -> list[str]:
    """Each setting against the first, in words that follow the interval over seeds."""
    out = []
    for setting, part in table[table[DIFF_VERDICT].fillna("") != ""].groupby("setting", sort=False):
        r = part.iloc[0]
        seeds = f"{len(part)} seed{'s' if len(part) > 1 else ''}"
        head = f"{setting} against {r[VS]}: the end reward differs by {r[DIFF]:+.3g} (mean over {seeds})"
        need = r[SEEDS_NEEDED]
        if r[DIFF_VERDICT] == TOO_FEW_SEEDS:
            out.append(f"{head}; with fewer than {MIN_SEEDS} seeds per setting there is no spread to judge it by, "
                       f"so it cannot separate the settings (--seeds {max(MIN_SEEDS, 3)} or more)")
        elif r[DIFF_VERDICT] == DIFFERS:
            out.append(f"{head}, {LEVEL:.0%} interval over seeds {r[DIFF + '_ci_low']:+.3g} to "
                       f"{r[DIFF + '_ci_high']:+.3g}: the settings differ")
        else:
            more = ("" if pd.isna(need) else f"; a difference this large would need about {int(need)} seeds per "
                    "setting" + (" or more" if int(need) >= MOST_SEEDS else ""))
            out.append(f"{head}, {LEVEL:.0%} interval over seeds {r[DIFF + '_ci_low']:+.3g} to "
                       f"{r[DIFF + '_ci_high']:+.3g}: no detectable difference, {seeds} cannot separate them{more}")
    return out
