import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from divergence_probe.numerics.rl_metrics import bucket_table, log_factors, ratio_split, sequence_metrics, token_metrics

logprobs = st.lists(st.floats(-12, 0), min_size=1, max_size=40)


def test_hand_computed_values():
    lp_infer = np.log([0.5, 0.25])
    lp_train = np.log([0.25, 0.25])  # r = [-ln 2, 0], rho = [0.5, 1]
    m = token_metrics(lp_infer, lp_train, clip_eps=0.2, tis_cap=2.0)
    ln2 = math.log(2)
    assert m["mean_abs_dlogp"] == pytest.approx(ln2 / 2) and m["max_abs_dlogp"] == pytest.approx(ln2)
    assert m["mean_abs_dp"] == pytest.approx(0.125) and m["max_abs_dp"] == pytest.approx(0.25)
    assert m["k1"] == pytest.approx(ln2 / 2)
    assert m["k2"] == pytest.approx(ln2**2 / 4)
    assert m["k3"] == pytest.approx(((0.5 - 1 + ln2) + 0) / 2)
    assert m["k3_clamped"] == m["k3"]  # far inside verl's clamp
    assert m["frac_abs_dlogp_over_ln2"] == 0  # |r| = ln 2 exactly is not beyond a factor of two
    assert m["ratio_mean"] == pytest.approx(0.75) and m["ratio_min"] == pytest.approx(0.5) and m["ratio_max"] == 1
    assert m["ppo_clip_frac"] == 0.5 and m["tis_truncated_frac"] == 0 and m["mis_masked_frac"] == 0
    assert m["ess"] == pytest.approx(1.5**2 / (2 * 1.25))


@settings(max_examples=100, deadline=None)
@given(logprobs, st.lists(st.floats(-0.5, 0.5), min_size=40, max_size=40))
def test_properties(lp_infer, noise):
    lp_infer = np.array(lp_infer)
    lp_train = lp_infer + np.array(noise[: len(lp_infer)])
    m = token_metrics(lp_infer, lp_train, 0.2, 2.0)
    assert m["k3"] >= -1e-15 and m["k2"] >= 0  # k3 = (rho - 1) - log rho >= 0
    assert 0 < m["ess"] <= 1 + 1e-12
    for frac in ("ppo_clip_frac", "tis_truncated_frac", "mis_masked_frac"):
        assert 0 <= m[frac] <= 1
    assert m["ratio_min"] <= m["ratio_mean"] <= m["ratio_max"]


@given(logprobs)
def test_no_mismatch_means_ratio_one_and_nothing_clipped(lp):
    m = token_metrics(np.array(lp), np.array(lp), 0.2, 2.0)
    assert m["ratio_mean"] == m["ratio_min"] == m["ratio_max"] == 1.0 and m["ratio_std"] == 0
    assert m["ppo_clip_frac"] == m["tis_truncated_frac"] == m["mis_masked_frac"] == 0
    assert m["k1"] == m["k2"] == m["k3"] == 0 and m["ess"] == 1.0


def test_sequence_metrics_and_buckets():
    responses = pd.DataFrame({
        "prompt_id": [0, 0, 0, 1], "sample_id": [0, 0, 1, 0],
        "delta_logprob": [0.1, 0.2, -0.3, 0.0],
        "logprob_infer": np.log([0.9995, 0.5, 0.0005, 0.05]), "logprob_train": np.log([0.9995, 0.5, 0.0005, 0.05]),
        "kl": [0.0, 0.1, 0.2, 0.3], "response_position": [0, 1, 0, 20],
    })
    m = sequence_metrics(responses, clip_eps=0.2)
    assert m["n_sequences"] == 3
    assert m["seq_mean_abs_logratio"] == pytest.approx((0.3 + 0.3 + 0.0) / 3)
    assert m["seq_max_abs_logratio"] == pytest.approx(0.3)
    assert m["mean_logppl_diff"] == pytest.approx(-(0.15 - 0.3 + 0.0) / 3)
    table = bucket_table(responses, 0.2, 2.0)
    by_prob = table[table.group == "p_infer"].set_index("bucket")["n_tokens"]
    assert by_prob["[0, 0.001)"] == 1 and by_prob["[0.9, 1]"] == 1 and by_prob["[0.01, 0.1)"] == 1
    by_pos = table[table.group == "response_position"].set_index("bucket")["n_tokens"]
    assert by_pos["[0, 16)"] == 3 and by_pos["[16, 64)"] == 1


def test_the_tail_metrics_see_what_the_mean_hides():
    """One token 20 nats off among many exact ones: the clamped k3 caps its term at verl's 10, the unclamped does not,
    and the tail share counts it."""
    lp_infer = np.log(np.full(10, 0.5))
    lp_train = lp_infer.copy()
    lp_train[3] = lp_infer[3] + 20.0  # rho = e^20: k3 term e^20 - 1 - 20
    m = token_metrics(lp_infer, lp_train, clip_eps=0.2, tis_cap=2.0)
    assert m["k3_clamped"] == pytest.approx(10.0 / 10)
    assert m["k3"] == pytest.approx((math.exp(20) - 21) / 10)
    assert m["frac_abs_dlogp_over_ln2"] == pytest.approx(0.1)


def test_the_log_factors_add_up_to_the_log_ratio_exactly_in_float64():
    """float32 logprobs of one token spread over [-40, -1e-6] (within 2^28 of each other): the three factors of
    π_train/π_recorded, added in order in float64, are log π_train − log π_recorded to the bit; the same sums in
    float32 are not, so the arithmetic is a choice (log_factors says why float64 is exact)."""
    rng = np.random.default_rng(0)
    t, p, d, r = (-np.exp(rng.uniform(math.log(1e-6), math.log(40), 10_000))).astype(np.float32).reshape(4, -1)
    f = log_factors({"train": t, "prefill": p, "decode": d, "recorded": r})
    assert list(f) == ["train_vs_prefill", "prefill_vs_decode", "decode_vs_recorded"]
    total = t.astype(np.float64) - r.astype(np.float64)
    assert ((f["train_vs_prefill"] + f["prefill_vs_decode"]) + f["decode_vs_recorded"] == total).all()
    assert (((t - p) + (p - d)) + (d - r) != t - r).any()


def test_ratio_split_names_the_dominant_factor():
    t, p, d = np.array([-1.0, -2.0]), np.array([-1.0, -2.5]), np.array([-1.25, -2.0])
    s = ratio_split({"train": t, "prefill": p, "decode": d, "recorded": d})
    assert s["train_vs_prefill_mean_abs_dlogp"] == 0.25 and s["train_vs_prefill_mean_dlogp"] == 0.25
    assert s["prefill_vs_decode_mean_abs_dlogp"] == 0.375 and s["prefill_vs_decode_mean_dlogp"] == -0.125
    assert s["decode_vs_recorded_mean_abs_dlogp"] == 0 == s["decode_vs_recorded_mean_dlogp"]
    assert s["dominant_factor"] == "prefill_vs_decode"
    assert ratio_split({"train": t, "prefill": t, "decode": t, "recorded": t})["dominant_factor"] == "none"
