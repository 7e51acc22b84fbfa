"""The report's tables: the summary with every column's meaning, an ablation's combinations and attribution, the
buckets, where the gap comes from (--graft, --depth) and the noise-floor tables a run may carry."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..numerics.graft_reading import amplification_text, families_by_local, findings
from ..numerics.shapley import SHIPPED
from ..numerics.tables import NOT_CAPTURED
from .attribution import attribution_section
from .document import Column, Heading, Paragraph, Table
from .recorded import MEANINGS
from .reference import MEANINGS as REFERENCE_MEANINGS
from .run_data import RunData, row_of, shipped_rows
from .wording import _get

# Column meanings as docs/reference/outputs.md ("Output files") and docs/reference/generate-mode.md ("Reading the RL
# metrics", "The noise floor") document them.
# In generate mode r = logprob_train − logprob_infer of a sampled response token and ρ = exp(r).
SUMMARY_MEANINGS = {
    "mean_abs_dlogp": "mean |Δlogprob| over scored tokens (nats)",
    "max_abs_dlogp": "largest |Δlogprob| (nats)",
    "p99_abs_dlogp": "99th percentile of |Δlogprob| (nats)",
    "std_abs_dlogp": "standard deviation of |Δlogprob| (nats)",
    "mean_kl": "mean per-token KL(π_infer ‖ π_train) over the full vocabulary (nats)",
    "max_kl": "largest per-token KL (nats)",
    "first_inexact": "first tap, in forward order, that is not bitwise equal (`tap@layer`)",
    "first_over_threshold": "first tap whose rel_l2 exceeds the threshold",
    "n_tokens": "scored tokens",
    "prompt_mean_abs_dlogp": "mean |Δlogprob| over the prompt tokens (nats)",
    "prompt_mean_kl": "mean full-vocabulary KL over the prompt tokens (nats)",
    "mean_abs_dp": "mean |π_train − π_infer| of the sampled token (probability)",
    "max_abs_dp": "largest |π_train − π_infer| of the sampled token (probability)",
    "k1": "mean of −r: k1 estimator of KL(π_infer ‖ π_train) from samples (nats)",
    "k2": "mean of r²/2: k2 estimator of the KL (nats)",
    "k3": "mean of (ρ − 1) − r: k3 estimator of the KL, ≥ 0 (nats)",
    "ratio_mean": "mean importance ratio ρ",
    "ratio_std": "standard deviation of ρ",
    "ratio_min": "smallest ρ",
    "ratio_max": "largest ρ",
    "ppo_clip_frac": "fraction of response tokens with ρ outside [1−ε, 1+ε]: PPO clipping from numerics alone",
    "tis_truncated_frac": "fraction with ρ above the TIS cap C (truncated importance sampling)",
    "mis_masked_frac": "fraction with ρ outside [1/C, C] (masked importance sampling)",
    "ess": "effective sample size fraction (Σρ)²/(n Σρ²), in (0, 1]",
    "n_response_tokens": "response tokens",
    "seq_mean_abs_logratio": "mean over responses of |Σ r| (nats)",
    "seq_max_abs_logratio": "largest |Σ r| over responses (nats)",
    "mean_logppl_diff": "mean over responses of log PPL_train − log PPL_infer",
    "ppl_ratio": "exp(mean_logppl_diff): PPL_train / PPL_infer",
    "seq_geo_ratio_outside_frac": "fraction of responses whose geometric-mean ratio is outside [1−ε, 1+ε]",
    "n_sequences": "responses",
    "noise_infer_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the inference stack, one sequence per call vs one batch",
    "noise_train_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the training stack, one sequence per call vs one batch",
    "noise_train_kernel_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the training stack under another SDPA "
                                         "attention kernel",
    "noise_infer_engine_mode_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the engine in its other mode (eager vs "
                                              "compiled)",
    "noise_infer_tensor_parallel_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the engine at tensor_parallel_size 1 "
                                                  "vs this run's",
    "noise_train_tensor_parallel_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the training stack unsharded vs "
                                                  "this run's --train-tp",
    "frac_tokens_any_flip": "routed positions the two stacks ran through different experts (the ids each router "
                            "returned) in at least one MoE layer",
    "frac_tokens_after_flip": "scored tokens whose logits came from a position that flipped in some layer",
    "mean_abs_dlogp_after_flip": "mean |Δlogprob| of the tokens right after a flip (nats)",
    "mean_abs_dlogp_not_after_flip": "mean |Δlogprob| of the other tokens (nats)",
    "frac_tokens_upstream_flip": "scored tokens with a flip at any earlier position of their sequence",
    "mean_abs_dlogp_upstream_flip": "mean |Δlogprob| of the tokens with an upstream flip (nats)",
    "mean_abs_dlogp_no_upstream_flip": "mean |Δlogprob| of the tokens without one (nats)",
    "noise_infer_frac_experts_differ": "routing noise floor: the inference stack against itself, one sequence per "
                                       "call vs one batch: fraction of tokens it ran through other experts, mean over "
                                       "layers",
    "noise_train_frac_experts_differ": "routing noise floor: the same for the training stack",
    "noise_train_kernel_frac_experts_differ": "routing noise floor: the training stack against itself under another "
                                              "SDPA kernel: fraction of tokens it ran through other experts, mean over "
                                              "layers",
    "noise_infer_frac_topk_set_differs": "routing noise floor: the inference stack against itself, one sequence per "
                                         "call vs one batch: fraction of tokens whose router logits' top-k set "
                                         "differs under every tie-break, mean over layers",
    "noise_train_frac_topk_set_differs": "routing noise floor: the same for the training stack",
    "noise_infer_frac_tokens_any_flip": "routing noise floor: positions the inference stack runs through other "
                                        "experts against itself in at least one layer",
    "noise_train_frac_tokens_any_flip": "routing noise floor: the same for the training stack",
    "noise_train_kernel_frac_topk_set_differs": "routing noise floor: the training stack against itself under another "
                                                "SDPA kernel (kernel_noise.csv's change): fraction of tokens whose "
                                                "router logits' top-k set differs, mean over layers",
    "noise_train_kernel_frac_tokens_any_flip": "routing noise floor: positions that kernel change flips in at least "
                                               "one layer",
    "routing_largest_noise_floor": "the largest routing noise floor measured (its summary column)",
    "routing_noise_floor_kind": "that floor's kind: noise (a stack's batch change) or systematic (the trainer's "
                                "kernel change)",
    "frac_tokens_any_flip_over_largest_floor": "frac_tokens_any_flip over the largest routing noise floor",
    "tap_points_mean_abs_dlogp": "mean |Δlogprob| of the compiled engine with tap points vs one built without them "
                                 "(0: the tap points left its numerics alone)",
    "train_vs_prefill_mean_abs_dlogp": "mean |logprob_train − logprob_prefill|: the trainer vs the engine's prefill of "
                                       "the same sequence, the stacks' numerics (nats)",
    "train_vs_prefill_mean_dlogp": "mean of logprob_train − logprob_prefill (nats)",
    "prefill_vs_decode_mean_abs_dlogp": "mean |logprob_prefill − logprob_infer|: the engine's prefill vs its own decode "
                                        "path (nats)",
    "prefill_vs_decode_mean_dlogp": "mean of logprob_prefill − logprob_infer (nats)",
    "dominant_factor": "the factor of π_train/π_recorded with the largest mean |log factor|",
    "mismatch_over_floor": "mean_abs_dlogp / the largest floor measured (noise or systematic: noise_floor_kind)",
    "mismatch_over_floor_ci_low": "low end of the 95% bootstrap interval of that ratio (prompts resampled, the "
                                  "mismatch's and the floor's together; empty below the minimum number of prompts)",
    "mismatch_over_floor_ci_high": "high end of that interval",
    "noise_verdict": "above_floor (the whole interval above 1), within_floor (none of it above 1), cannot_tell "
                     "(it straddles 1: more prompts would narrow it) or too_few_prompts (no interval)",
    "noise_floor_used": "the floor the ratio and the verdict are against (its summary column)",
    "noise_floor_kind": "that floor's kind: noise (a stack's batch or run-to-run wobble) or systematic (a kernel, "
                        "mode or sharding swap)",
    "noise_verdict_prompts": "the prompts the ratio's interval resampled",
}
# The columns of buckets.csv the report shows (the CSV has every token metric per bucket).
BUCKET_COLUMNS = ("group", "bucket", "n_tokens", "mean_kl", "mean_abs_dlogp", "max_abs_dlogp", "k3", "ratio_min",
                  "ratio_max", "ppo_clip_frac")


EXTRA_TABLES = {
    "batch_invariance": "Noise floor (batch_invariance.csv): each stack scores the same sequences one per call and "
                        "then all in one batch; the columns compare the two.",
    "kernel_noise": "Noise floor (kernel_noise.csv): the training stack scores the same sequences with another SDPA "
                    "attention kernel (and, at --train-tp N, unsharded: `train_tp 1 vs N`); the columns compare the "
                    "two.",
    "local_families": "Local error per op family (local_families.csv, from compare --graft): the training stack's op "
                      "on the inference stack's inputs of each seam (`local_*`) and the ordinary per-tap diff "
                      "(`propagated_*`), pooled over the family's seams, largest local error first; `amplification` = "
                      "propagated / local rel_l2 (where the local error is 0 there is no ratio: the family makes no "
                      "error of its own and passes on what it receives). local.csv has every seam and layer.",
    "depth": "Depth attribution (depth.csv, from compare --depth): the training forward continued from the inference "
             "stack's `graft` tensor, scored against the inference logits.",
    "engine_noise": "Noise floor (engine_noise.csv): a second vLLM engine in the other engine mode (eager vs compiled, "
                    "the same regions aligned) scores the same sequences, and a compiled engine with tap points is "
                    "also scored against one built without them; an engine at tensor_parallel_size N > 1 is scored "
                    "against the same engine at 1 instead; the columns compare each with this run's engine.",
}



def _not_captured(frame: pd.DataFrame) -> list[str]:
    """The tap columns of a run without taps (`--taps none`): they hold only "not captured", so they are left out."""
    return [c for c in ("first_inexact", "first_over_threshold")
            if c in frame and (frame[c].astype(str) == NOT_CAPTURED).all()]


def _summary_table(run: RunData) -> Table:
    s = run.summary
    cols = [c for c in s.columns if c != "combo" and c not in _not_captured(s)]

    def meaning(c: str) -> str:
        if c == "first_over_threshold" and _get(run.manifest, "compare", "threshold") is not None:
            return f"first tap whose rel_l2 exceeds {_get(run.manifest, 'compare', 'threshold')}"
        if run.is_score and c in MEANINGS:
            return MEANINGS[c]
        if c in SUMMARY_MEANINGS or c in REFERENCE_MEANINGS:
            text = SUMMARY_MEANINGS.get(c) or REFERENCE_MEANINGS[c]
            return text.replace("scored tokens", "response tokens") if run.is_generate else text
        if c.startswith("ratio_"):
            return ("importance-ratio statistic, ρ = exp(Δlogprob) on response tokens "
                    "(docs/reference/generate-mode.md)")
        return ""

    def value(v):
        return v.item() if isinstance(v, np.generic) else v

    if "combo" in s:
        shown = [SHIPPED] + ([run.all_aligned] if run.all_aligned and run.all_aligned != SHIPPED else [])
        shown = [c for c in shown if (s["combo"] == c).any()] or [str(s["combo"].iloc[0])]
        rows = tuple((c, *(value(row_of(s, k)[c]) for k in shown), meaning(c)) for c in cols)
        return Table("summary", "Headline numbers (summary.csv): as shipped and with every region aligned.",
                     (Column("quantity", "code"), *(Column(k, "auto") for k in shown), Column("meaning", "prose")),
                     rows)
    if len(s) == 1:
        rows = tuple((c, value(s.iloc[0][c]), meaning(c)) for c in cols)
        return Table("summary", "Headline numbers (summary.csv).",
                     (Column("quantity", "code"), Column("value", "auto"), Column("meaning", "prose")), rows)
    return _generic_table("summary", "Headline numbers (summary.csv).", s)


def _kind(series: pd.Series) -> str:
    if series.dtype == bool:
        return "bool"
    if pd.api.types.is_integer_dtype(series):
        return "int"
    if pd.api.types.is_float_dtype(series):
        return "num"
    return "code"


def _generic_table(name: str, caption: str, df: pd.DataFrame) -> Table:
    columns = tuple(Column(c, _kind(df[c])) for c in df.columns)
    rows = tuple(tuple(None if pd.isna(v) else v for v in row) for row in df.itertuples(index=False, name=None))
    return Table(name, caption, columns, rows)


def _ablation_table(run: RunData) -> Table:
    df = run.ablation.sort_values(run.metric, kind="stable")
    caption = (f"Every combination of aligned regions (ablation.csv), sorted by `{run.metric}`, lowest first; "
               "yes = the region is aligned (FP32 until its output, one rounding).")
    if "n_tokens" in df and df["n_tokens"].nunique() == 1:
        caption += f" Every combination scores the same {int(df['n_tokens'].iloc[0])} tokens."
        df = df.drop(columns=["n_tokens"])
    first = ["combo", *run.regions, run.metric]
    df = df[first + [c for c in df.columns if c not in first and c not in _not_captured(df)]]
    table = _generic_table("ablation", caption, df)
    return Table(table.name, table.caption, tuple(
        Column(c.title, "bool" if c.title in run.regions else c.kind) for c in table.columns), table.rows)



def tables_section(run: RunData) -> list:
    blocks: list = [Heading("Tables"), _summary_table(run)]
    if run.is_ablate:
        blocks.append(_ablation_table(run))
    blocks += attribution_section(run)
    if "buckets" in run.extra:
        b = run.extra["buckets"]
        shown = b[[c for c in BUCKET_COLUMNS if c in b.columns]]
        empty = int((shown["n_tokens"] == 0).sum()) if "n_tokens" in shown else 0
        if empty:
            shown = shown[shown["n_tokens"] > 0]
        blocks.append(_generic_table(
            "buckets", "Response-token metrics per bucket of the inference-side probability of the sampled token "
            "(`group` p_infer) and per response-position range (`group` response_position), from buckets.csv"
            + (f"; {empty} empty buckets left out" if empty else "") + ". The CSV has every token metric per bucket.",
            shown))
    graft = findings({stem: shipped_rows(run.extra[stem]) for stem in ("local_families", "depth")
                      if stem in run.extra}, run.num_layers)
    if graft:
        blocks.append(Paragraph("**Where the gap comes from" + (" (stacks as shipped)" if run.is_ablate else "")
                                + ".** " + " ".join(graft)))
    for stem, caption in EXTRA_TABLES.items():
        if stem == "local_families" and stem in run.extra:
            blocks.append(_families_table(caption, run.extra[stem]))
        elif stem in run.extra:
            blocks.append(_generic_table(stem, caption, run.extra[stem]))
    return blocks


def _families_table(caption: str, families: pd.DataFrame) -> Table:
    """local_families.csv largest local error first, its amplification in words where the local error is 0."""
    table = _generic_table("local_families", caption, families_by_local(families).drop(columns=["amplification"]))
    rows = tuple((*row, amplification_text(record)) for row, record in
                 zip(table.rows, families_by_local(families).to_dict("records")))
    return Table(table.name, table.caption, (*table.columns, Column("amplification", "auto")), rows)


