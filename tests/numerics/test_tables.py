"""The summary's four headline numbers are one computation (numerics.tables.headline): summary.csv, each noise
floor's row and each depth point read them from it, under the same names in the same order."""

from __future__ import annotations

import math

import numpy as np

from divergence_probe.numerics.tables import HEADLINE, SUMMARY_COLUMNS, headline, summary_of


def test_every_table_of_headline_numbers_takes_them_from_one_computation():
    from divergence_probe.runs.batch_invariance import COLUMNS, KERNEL_COLUMNS
    from divergence_probe.runs.graft import DEPTH_COLUMNS

    rng = np.random.default_rng(0)
    delta, kl = rng.normal(0, 1e-2, 50), rng.exponential(1e-4, 50)
    row = summary_of(delta, kl, {}, 1e-3)
    assert list(row) == SUMMARY_COLUMNS
    assert {k: row[k] for k in HEADLINE} == headline(np.abs(delta), kl)
    for columns in (SUMMARY_COLUMNS, COLUMNS, KERNEL_COLUMNS, DEPTH_COLUMNS):
        assert [c for c in columns if c in HEADLINE] == list(HEADLINE), columns


def test_no_token_has_no_headline_number():
    """A depth point no sequence reached: NaN, not a mean of nothing or an error."""
    assert all(math.isnan(v) for v in headline(np.zeros(0), np.zeros(0)).values())
