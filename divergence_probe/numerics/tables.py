"""Turn a run's raw results into the tables of tokens.csv, layers.csv and summary.csv.

Column meanings are documented in docs/reference/outputs.md ("Output files"); keep the two in step.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

TOKEN_COLUMNS = ["prompt_id", "position", "token_id", "token", "logprob_infer", "logprob_train", "delta_logprob", "kl"]
LAYER_COLUMNS = ["layer", "tap", "max_abs", "mean_abs", "rel_l2", "cosine", "frac_equal", "max_ulp"]
# The four headline numbers of a set of scored tokens (`headline`): summary.csv's, each noise floor's row, each depth
# point's; the terminal, the report and the gate read them by these names.
HEADLINE = ("mean_abs_dlogp", "max_abs_dlogp", "mean_kl", "max_kl")
SUMMARY_COLUMNS = [
    "mean_abs_dlogp", "max_abs_dlogp", "p99_abs_dlogp", "mean_kl", "max_kl",
    "first_inexact", "first_over_threshold", "n_tokens",
]
NOT_CAPTURED = "not captured"  # no taps were requested (--taps none)
NO_DIVERGENCE = "none"  # every captured tap was bitwise equal / under the threshold


# summary.csv's noise floors (compare.noise_floor_columns), each with the change that made it: one stack against
# itself. A mismatch is read against the largest one measured: on real shapes one kernel change can move logprobs as
# much as the whole gap (docs/reference/generate-mode.md, "The noise floor").
NOISE_FLOORS = {
    "noise_infer_mean_abs_dlogp": "the inference stack's own batch change",
    "noise_train_mean_abs_dlogp": "the training stack's own batch change",
    "noise_train_kernel_mean_abs_dlogp": "the training stack's own attention-kernel change",
    "noise_infer_engine_mode_mean_abs_dlogp": "the engine's own change of mode",
    "noise_infer_tensor_parallel_mean_abs_dlogp": "the engine's own change of tensor parallelism",
    "noise_train_tensor_parallel_mean_abs_dlogp": "the training stack's own change of tensor parallelism",
}
# Each floor's kind: noise, a stack's own wobble from batch to batch or run to run, which no setting removes; or
# systematic, one deliberate swap (a kernel, an engine mode, a sharding) that moves logprobs the same way every time.
# A mismatch within a systematic floor is no larger than that swap makes, which is not the same as being noise.
NOISE, SYSTEMATIC = "noise", "systematic"
FLOOR_KINDS = {
    "noise_infer_mean_abs_dlogp": NOISE,
    "noise_train_mean_abs_dlogp": NOISE,
    "noise_train_kernel_mean_abs_dlogp": SYSTEMATIC,
    "noise_infer_engine_mode_mean_abs_dlogp": SYSTEMATIC,
    "noise_infer_tensor_parallel_mean_abs_dlogp": SYSTEMATIC,
    "noise_train_tensor_parallel_mean_abs_dlogp": SYSTEMATIC,
    # the routing floors (ROUTING_NOISE_FLOORS, below), by the same rule
    "noise_infer_frac_tokens_any_flip": NOISE,
    "noise_train_frac_tokens_any_flip": NOISE,
    "noise_train_kernel_frac_tokens_any_flip": SYSTEMATIC,
}
# summary.csv's routing noise floors (compare.routing_noise_columns): the share of positions a stack runs through other
# experts, in at least one layer, against itself under one change. The cross-stack frac_tokens_any_flip is read
# against the largest one measured, as the logprob mismatch is against NOISE_FLOORS.
ROUTING_NOISE_FLOORS = {
    "noise_infer_frac_tokens_any_flip": "the inference stack's own batch change",
    "noise_train_frac_tokens_any_flip": "the training stack's own batch change",
    "noise_train_kernel_frac_tokens_any_flip": "the training stack's own attention-kernel change",
}
ROLLOUT_TOKEN_COLUMNS = ["prompt_id", "sample_id", "position", "token_id", "token", "is_response",
                         "logprob_infer", "logprob_prefill", "logprob_train", "delta_logprob", "kl"]


def tokens_frame(tokens, sampled: bool = False) -> pd.DataFrame:
    """tokens.csv; `sampled` (generate mode) adds which sample a token belongs to, whether it was sampled and, when
    the engine re-scored the sequences in one prefill, that prefill's logprob."""
    columns = ROLLOUT_TOKEN_COLUMNS if sampled else TOKEN_COLUMNS
    if sampled and all(t.logprob_prefill is None for t in tokens):
        columns = [c for c in columns if c != "logprob_prefill"]
    # column by column: one list of a column's values at a time, not a dict per token (asdict deep-copies every field,
    # which for millions of tokens costs minutes and a dict per token)
    df = pd.DataFrame({c: pd.Series([getattr(t, c) for t in tokens], dtype=object if not tokens else None)
                       for c in columns if c != "delta_logprob"})
    # delta = train - infer: positive when the trainer finds the sampled token more likely than the engine did
    df.insert(columns.index("delta_logprob"), "delta_logprob", df["logprob_train"] - df["logprob_infer"])
    return df


def layers_frame(tap_stats) -> pd.DataFrame:
    rows = [{"layer": key.layer, "tap": key.name, **stats.row()} for key, stats in sorted(tap_stats.items())]
    return pd.DataFrame(rows, columns=LAYER_COLUMNS)


def first_divergence(tap_stats, diverged) -> str:
    """Label (`tap@layer`) of the first tap in forward order for which diverged(stats) holds."""
    if not tap_stats:
        return NOT_CAPTURED
    for key, stats in sorted(tap_stats.items()):
        if diverged(stats):
            return key.label
    return NO_DIVERGENCE


def summary_row(tokens, tap_stats, threshold: float) -> dict:
    delta = np.array([t.logprob_train - t.logprob_infer for t in tokens], dtype=np.float64)
    kl = np.array([t.kl for t in tokens], dtype=np.float64)
    return summary_of(delta, kl, tap_stats, threshold)


def summary_of(delta: np.ndarray, kl: np.ndarray, tap_stats, threshold: float) -> dict:
    """summary_row of the tokens' delta_logprob and kl columns (a tokens table's, or the tokens')."""
    abs_delta = np.abs(delta)
    row = headline(abs_delta, kl) | {
        "p99_abs_dlogp": float(np.percentile(abs_delta, 99)),
        "first_inexact": first_divergence(tap_stats, lambda s: not s.bitwise_equal),
        "first_over_threshold": first_divergence(tap_stats, lambda s: s.rel_l2 > threshold),
        "n_tokens": len(delta),
    }
    return {column: row[column] for column in SUMMARY_COLUMNS}


def headline(abs_dlogp: np.ndarray, kl: np.ndarray) -> dict[str, float]:
    """HEADLINE of a set of tokens, from their |Δlogp| and their KL(infer‖train): the mean and the largest of each,
    NaN where there is no token to average (a depth point no sequence reached)."""
    def mean_max(values: np.ndarray) -> tuple[float, float]:
        return (float(values.mean()), float(values.max())) if len(values) else (float("nan"), float("nan"))

    return dict(zip(HEADLINE, (*mean_max(abs_dlogp), *mean_max(kl))))


def worst_layer(tap_stats, tap: str = "resid_out") -> tuple[int, float] | None:
    """(layer, rel_l2) of the decoder layer whose output stream differs most; None when not captured."""
    candidates = [(stats.rel_l2, key.layer) for key, stats in tap_stats.items() if key.name == tap]
    if not candidates:
        return None
    rel, layer = max(candidates)
    return layer, rel


def noise_floors(summary, floors: dict[str, str] = NOISE_FLOORS) -> dict[str, float]:
    """The noise floors a run measured (summary column -> value), in the order of `floors` (NOISE_FLOORS: mean
    |Δlogp|; ROUTING_NOISE_FLOORS: the share of positions routed differently)."""
    found = {}
    for name in floors:
        value = summary.get(name)
        if value is not None and not pd.isna(value):
            found[name] = float(value)
    return found


def largest_noise_floor(summary, floors: dict[str, str] = NOISE_FLOORS) -> tuple[str, float] | None:
    """The largest of `floors` a run measured, (summary column, value), or None when it measured none."""
    found = noise_floors(summary, floors)
    return max(found.items(), key=lambda item: item[1]) if found else None

