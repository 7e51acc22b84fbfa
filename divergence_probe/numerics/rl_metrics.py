"""The mismatch metrics RL practitioners watch, from per-token logprobs of sampled responses. Pure numpy.

With r = logπ_train − logπ_infer per response token (the sampled token) and ρ = exp(r), the importance
ratio a trainer applies to a sample drawn from the engine:
- |Δlogp| = |r| (slime `train_rollout_logprob_abs_diff`, open-instruct `vllm_vs_local_logprob_diff`),
  |Δp| = |π_train − π_infer| (verl `rollout_probs_diff`);
- KL(π_infer ‖ π_train) estimators from samples x ~ π_infer: k1 = −r, k2 = r²/2, k3 = (ρ − 1) − r (≥ 0);
- per response: S = Σ r (the sequence log-ratio), the log-perplexity difference −mean(r) and its exp;
- ρ statistics, PPO clipping by numerics alone (ρ outside [1−ε, 1+ε]), TIS truncation (ρ > C), token MIS
  masking (ρ outside [1/C, C]), sequence geometric-mean ratio exp(mean r) outside [1−ε, 1+ε], and the
  normalised effective sample size (Σρ)² / (n Σρ²).
Formulas are repeated in docs/reference/generate-mode.md ("Reading the RL metrics").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

PROB_BUCKETS = (0.0, 1e-3, 1e-2, 1e-1, 0.5, 0.9, 1.0000001)
POSITION_BUCKETS = (0, 16, 64, 256, 1024, np.inf)


K3_CLAMP = 10.0
LN2 = float(np.log(2.0))


def token_metrics(lp_infer: np.ndarray, lp_train: np.ndarray, clip_eps: float, tis_cap: float) -> dict[str, float]:
    """Token-level metrics over any set of response tokens (arrays of equal length)."""
    r = np.asarray(lp_train, dtype=np.float64) - np.asarray(lp_infer, dtype=np.float64)
    if r.size == 0:
        return {}
    rho = np.exp(r)
    dp = np.abs(np.exp(lp_train) - np.exp(lp_infer))
    return {
        "mean_abs_dlogp": float(np.abs(r).mean()),
        "max_abs_dlogp": float(np.abs(r).max()),
        "std_abs_dlogp": float(np.abs(r).std()),
        "mean_abs_dp": float(dp.mean()),
        "max_abs_dp": float(dp.max()),
        "k1": float((-r).mean()),
        "k2": float((0.5 * r * r).mean()),
        "k3": float((rho - 1.0 - r).mean()),
        # verl's low_var_kl (core_algos.kl_penalty) clamps each token's k3 to [-K3_CLAMP, K3_CLAMP] before the mean
        "k3_clamped": float(np.clip(rho - 1.0 - r, -K3_CLAMP, K3_CLAMP).mean()),
        # the tail: tokens whose two probabilities differ by more than a factor of two (ratio outside [1/2, 2])
        "frac_abs_dlogp_over_ln2": float((np.abs(r) > LN2).mean()),
        "ratio_mean": float(rho.mean()),
        "ratio_std": float(rho.std()),
        "ratio_min": float(rho.min()),
        "ratio_max": float(rho.max()),
        "ppo_clip_frac": float(((rho < 1 - clip_eps) | (rho > 1 + clip_eps)).mean()),
        "tis_truncated_frac": float((rho > tis_cap).mean()),
        "mis_masked_frac": float(((rho < 1 / tis_cap) | (rho > tis_cap)).mean()),
        "ess": float(rho.sum() ** 2 / (rho.size * (rho * rho).sum())),
        "n_response_tokens": int(r.size),
    }


def log_factors(logprobs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The ratio π_first/π_last of logprobs given in order (generate mode: train, prefill, decode, recorded) as a
    product of factors, one per neighbouring pair: `a_vs_b` = log π_a − log π_b per token, in float64.

    Their sum, added in this order, is log π_first − log π_last (delta_logprob) to the last bit. Every logprob is a
    float32 value (both stacks report them so), exact in float64. The difference of two float32 values is a multiple
    of the ULP of the smaller one and under four times the larger one's power of two, so it needs at most 25 bits plus
    the gap between their binary exponents: exact in float64's 53 while the two are within a factor 2^28 of each other
    (or one is 0), as logprobs of one token from four runs of one checkpoint are. Then each factor is exact, and so is
    each partial sum: factors added in order telescope to a difference of two float32 values again (train − decode,
    then train − recorded), which rounds to itself. In float32 the same sums round (tests/numerics/test_rl_metrics.py)."""
    names = list(logprobs)
    values = [np.asarray(logprobs[n], dtype=np.float64) for n in names]
    return {f"{a}_vs_{b}": x - y for a, b, x, y in zip(names, names[1:], values, values[1:])}


def ratio_split(logprobs: dict[str, np.ndarray]) -> dict[str, float | str]:
    """summary.csv's split of the RL ratio (`log_factors`): per factor the mean |log factor| (`_mean_abs_dlogp`) and
    its signed mean (`_mean_dlogp`), and `dominant_factor`, the one with the largest mean |log factor| (`none` when
    every factor is exactly 1)."""
    factors = log_factors(logprobs)
    out: dict[str, float | str] = {}
    for name, f in factors.items():
        out[f"{name}_mean_abs_dlogp"] = float(np.abs(f).mean())
        out[f"{name}_mean_dlogp"] = float(f.mean())
    largest = max(factors, key=lambda name: out[f"{name}_mean_abs_dlogp"])  # the first of equals, in order
    out["dominant_factor"] = largest if out[f"{largest}_mean_abs_dlogp"] > 0 else "none"
    return out


def sequence_metrics(responses: pd.DataFrame, clip_eps: float) -> dict[str, float]:
    """Per-response metrics; `responses` has sequence keys (prompt_id, sample_id) and delta_logprob."""
    g = responses.groupby(["prompt_id", "sample_id"], sort=True)["delta_logprob"]
    seq_sum, seq_mean = g.sum().to_numpy(), g.mean().to_numpy()
    if seq_sum.size == 0:
        return {}
    logppl_diff = -seq_mean  # log PPL_train − log PPL_infer of each response
    geo = np.exp(seq_mean)  # sequence-level geometric-mean importance ratio
    return {
        "seq_mean_abs_logratio": float(np.abs(seq_sum).mean()),
        "seq_max_abs_logratio": float(np.abs(seq_sum).max()),
        "mean_logppl_diff": float(logppl_diff.mean()),
        "ppl_ratio": float(np.exp(logppl_diff.mean())),
        "seq_geo_ratio_outside_frac": float(((geo < 1 - clip_eps) | (geo > 1 + clip_eps)).mean()),
        "n_sequences": int(seq_sum.size),
    }


def bucket_table(responses: pd.DataFrame, clip_eps: float, tis_cap: float) -> pd.DataFrame:
    """The token metrics per inference-probability bucket and per response-position range."""
    p = np.exp(responses["logprob_infer"].astype("float64"))
    by_prob = pd.cut(p, PROB_BUCKETS, right=False, labels=[
        f"[{lo:g}, {min(hi, 1):g}{']' if hi > 1 else ')'}" for lo, hi in zip(PROB_BUCKETS, PROB_BUCKETS[1:])])
    by_pos = pd.cut(responses["response_position"], POSITION_BUCKETS, right=False, labels=[
        f"[{lo:g}, {hi:g})" for lo, hi in zip(POSITION_BUCKETS, POSITION_BUCKETS[1:])])
    rows = []
    for group, keys in (("p_infer", by_prob), ("response_position", by_pos)):
        for label in keys.cat.categories:
            sel = (keys == label).to_numpy()
            part = responses[sel]
            m = token_metrics(part["logprob_infer"].to_numpy(), part["logprob_train"].to_numpy(), clip_eps, tis_cap)
            rows.append({"group": group, "bucket": str(label), "n_tokens": int(sel.sum()),
                         "mean_kl": float(part["kl"].mean()) if len(part) else float("nan"),
                         **{k: v for k, v in m.items() if k != "n_response_tokens"}})
    return pd.DataFrame(rows)
