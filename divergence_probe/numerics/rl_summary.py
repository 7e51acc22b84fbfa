"""rl_summary.csv: one line per (setting, seed) of an rl run, the reward and the mismatch at its start and its end,
read by the rl command, its run folder and its report alike."""

from __future__ import annotations

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
    return table
