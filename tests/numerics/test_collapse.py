"""numerics/collapse.py: a collapse is the reward falling below its start for good while the mismatch grows tenfold;
either alone, or a dip the run climbs out of, is not one."""

import numpy as np
import pandas as pd
import pytest

from divergence_probe.numerics.collapse import collapsed_at_step


def _run(reward, k3=None, tail=None):
    n = len(reward)
    return pd.DataFrame({"step": np.arange(1, n + 1), "reward_mean": reward,
                         "k3": k3 if k3 is not None else np.full(n, 1e-4),
                         "max_abs_dlogp": tail if tail is not None else np.full(n, 0.05)})


def test_a_fall_for_good_with_a_tenfold_kl_is_a_collapse_at_the_first_qualifying_step():
    reward = np.r_[np.full(40, 0.5), np.full(60, 0.0)]  # learned nothing, then lost everything at step 41
    k3 = np.r_[np.full(40, 1e-4), np.full(60, 2e-3)]  # 20x
    step = collapsed_at_step(_run(reward, k3=k3), width=10)
    # the 10-step rolling reward drops below 0.5 at step 41; the rolling k3 reaches 10x start at step 45
    assert step == 45


def test_the_tail_growing_counts_like_the_kl():
    reward = np.r_[np.full(30, 0.5), np.full(30, 0.1)]
    tail = np.r_[np.full(30, 0.05), np.full(30, 1.0)]
    # the rolling tail (0.05 * (40 - s) + 1.0 * (s - 30)) / 10 first reaches 10 x 0.05 at step 35
    assert collapsed_at_step(_run(reward, tail=tail), width=10) == 35


@pytest.mark.parametrize("case", ["reward falls, mismatch steady", "mismatch grows, reward holds", "dip recovers"])
def test_one_sign_alone_or_a_recovered_dip_is_no_collapse(case):
    n = 80
    k3_up = np.r_[np.full(30, 1e-4), np.full(n - 30, 1e-2)]
    if case == "reward falls, mismatch steady":
        run = _run(np.r_[np.full(30, 0.5), np.zeros(n - 30)])
    elif case == "mismatch grows, reward holds":
        run = _run(np.full(n, 0.5), k3=k3_up)
    else:
        run = _run(np.r_[np.full(30, 0.5), np.zeros(20), np.ones(n - 50)], k3=k3_up)
    assert collapsed_at_step(run, width=10) is None


def test_a_start_without_mismatch_needs_some_to_grow():
    """k3 exactly 0 at the start (both stacks bitwise equal): 10 x 0 is no threshold; the mismatch must be > 0."""
    run = _run(np.r_[np.full(30, 0.5), np.zeros(30)], k3=np.zeros(60), tail=np.zeros(60))
    assert collapsed_at_step(run, width=10) is None
