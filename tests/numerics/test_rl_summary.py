"""rl_summary.csv's comparison of settings over seeds (numerics/rl_summary.py): an interval from the seeds' spread,
no interval below MIN_SEEDS, and the seeds a difference would need."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from divergence_probe.numerics.rl_summary import DIFF, DIFF_VERDICT, DIFFERS, MIN_SEEDS, NOT_DETECTED, SEEDS_NEEDED, \
    TOO_FEW_SEEDS, VS, comparison_words, seeds_needed, t_quantile, with_comparison


def _runs(ends: dict[str, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"setting": s, "seed": i, "reward_end": r} for s, rs in ends.items() for i, r in enumerate(rs)])


def test_t_quantiles_match_the_printed_tables():
    for df, value in ((1, 12.706), (2, 4.303), (10, 2.228), (30, 2.042)):
        assert t_quantile(0.975, df) == pytest.approx(value, abs=1e-3)


def test_two_seeds_cannot_separate_settings_whose_seeds_overlap_and_the_words_say_how_many_would():
    table = with_comparison(_runs({"none": [0.45, 0.60], "rope": [0.50, 0.70]}))
    rope = table[table.setting == "rope"].iloc[0]
    assert rope[VS] == "none" and rope[DIFF] == pytest.approx(0.075)
    assert rope[DIFF + "_ci_low"] < 0 < rope[DIFF + "_ci_high"] and rope[DIFF_VERDICT] == NOT_DETECTED
    assert rope[SEEDS_NEEDED] > 2
    assert table[table.setting == "none"][DIFF_VERDICT].eq("").all()  # the first setting is the reference
    [words] = comparison_words(table)
    assert "no detectable difference, 2 seeds cannot separate them" in words
    assert f"about {rope[SEEDS_NEEDED]} seeds per setting" in words


def test_settings_apart_by_much_more_than_their_seeds_spread_differ():
    table = with_comparison(_runs({"none": [0.20, 0.21, 0.22], "rope": [0.60, 0.61, 0.62]}))
    rope = table[table.setting == "rope"].iloc[0]
    assert rope[DIFF_VERDICT] == DIFFERS and rope[DIFF + "_ci_low"] > 0
    assert "the settings differ" in comparison_words(table)[0]


def test_one_seed_gives_no_interval():
    table = with_comparison(_runs({"none": [0.2], "rope": [0.6]}))
    rope = table[table.setting == "rope"].iloc[0]
    assert rope[DIFF_VERDICT] == TOO_FEW_SEEDS and math.isnan(rope[DIFF + "_ci_low"]) and pd.isna(rope[SEEDS_NEEDED])
    assert f"fewer than {MIN_SEEDS} seeds" in comparison_words(table)[0]
    assert with_comparison(_runs({"none": [0.2, 0.3]}))[DIFF_VERDICT].eq("").all()  # one setting: nothing to compare


def test_seeds_needed_shrink_as_the_difference_grows():
    base = np.array([0.4, 0.5, 0.6])
    small, large = seeds_needed(base + 0.05, base), seeds_needed(base + 0.2, base)
    assert small > large >= MIN_SEEDS
