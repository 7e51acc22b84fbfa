"""When an rl run has collapsed: the definition docs/reference/rl.md ("When a run has collapsed") gives, read from
rl.csv.

A collapse is what the published failures show together: the reward falls below where the run started and stays
there, while the two stacks' policies come apart, the mismatch growing by an order of magnitude. Either alone is
not one: a reward that falls with a steady mismatch is a failure of the task or the optimizer (GRPO without signal),
and a mismatch that grows while the reward holds is a policy sharpening or spreading out (the mismatch follows the
policy's entropy). Means over a window of steps, so one unlucky step decides nothing; "stays" means to the end of the
run, so a dip the run climbs out of is not a collapse.
"""

from __future__ import annotations

import pandas as pd

GROWTH = 10.0  # "by an order of magnitude"
MISMATCH = ("k3", "max_abs_dlogp")  # the KL estimate and the |Δlogp| tail; either growing counts


def collapsed_at_step(run: pd.DataFrame, width: int) -> int | None:
    """The first step s of one (setting, seed) run (rows in step order) at which the mean reward over the `width`
    steps ending at s is below its mean over the first `width` steps, and stays below to the end of the run, while
    the mean k3 or the mean largest |Δlogp| over those steps is at least GROWTH times its mean over the first ones.
    Only windows after the first (s >= 2 * width) count, so the start is never compared with itself. None when no
    step qualifies."""
    steps = run["step"].to_numpy()
    rolling = run[["reward_mean", *MISMATCH]].rolling(width).mean()
    start = run[["reward_mean", *MISMATCH]].head(width).mean()
    below = (rolling["reward_mean"] < start["reward_mean"]).to_numpy()
    stays = below[::-1].cumprod()[::-1].astype(bool)  # below at this step and at every later one
    grown = pd.concat([(rolling[m] >= GROWTH * start[m]) & (rolling[m] > 0) for m in MISMATCH], axis=1).any(axis=1)
    for i in range(2 * width - 1, len(run)):
        if stays[i] and grown.iloc[i]:
            return int(steps[i])
    return None
