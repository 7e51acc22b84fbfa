"""The report of a score run: what the user's own RL run recorded, against the trainer and, when measured, the
engine's prefill of the same sequences.

A score run has no taps and no noise floor of its own; what it has instead is the three-way split (recorded vs
prefill: the decode path or the recording; prefill vs trainer: the engine's numerics; recorded vs trainer: what the
run's importance ratios saw) and, when the recording is far from both, the explanation that fits (runs/score.py
`diagnosis`). Throughout the report the recorded logprobs stand where a compare run has the engine's (tokens.csv's
`logprob_rollout` is read as `logprob_infer`), so the figures and ratios read the same way. Columns:
docs/reference/score.md, "score".
"""

from __future__ import annotations

import pandas as pd

from .document import Heading, Paragraph
from .run_data import RunData, row_of
from .wording import FACTORS, _code, _get, _num

# summary.csv columns a score run adds, for the summary table's meaning column
MEANINGS = {
    "rollout_vs_train_mean_abs_dlogp": "mean |logprob_rollout − logprob_train|: what the run's importance ratios saw "
                                       "(nats)",
    "rollout_vs_prefill_mean_abs_dlogp": "mean |logprob_rollout − logprob_prefill|: the decode path, or the recording "
                                         "(nats)",
    "prefill_vs_train_mean_abs_dlogp": "mean |logprob_prefill − logprob_train|: the engine's numerics (nats)",
    "prefill_vs_recorded_mean_dlogp": "mean of logprob_prefill − logprob_rollout (nats)",
    "dominant_factor": "the factor of π_train/π_recorded with the larger mean |log factor|: train_vs_prefill "
                       "(prefill_vs_train_mean_abs_dlogp) or prefill_vs_recorded (rollout_vs_prefill_mean_abs_dlogp)",
    "far_bound": "how far (mean |Δlogprob|, nats) the recording may be from the trainer before it is called far",
    "recorded_far": "the recorded logprobs are farther than far_bound from the trainer (and the prefill)",
    "wrong_token_share": "share of the gap on tokens the model gives < 1e-4 that the recording calls likelier",
    "tempered_mean_abs_dlogp": "mean |logprob_rollout − trainer logprob at --temperature, or at fitted_temperature| "
                               "(nats)",
    "untempered_mean_abs_dlogp": "with --temperature: mean |logprob_rollout − the trainer's raw logprob| (nats)",
    "fitted_temperature": "without --temperature: the tested temperature whose trainer logprobs are closest to the "
                          "recording",
    "likely_cause": "the explanation that fits a far recording (a flag, not a verdict); empty when not far",
}


def setup_items(run: RunData) -> list[str]:
    """The Setup lines that say what was scored: the file, its layout, and who re-scored it."""
    s = _get(run.manifest, "score", default={})
    sha = str(s.get("rollouts_sha256", ""))
    items = [f"Rollouts: {_code(str(s.get('rollouts', 'unknown')).rsplit('/', 1)[-1])} "
             f"({s.get('n_rollouts', 'unknown')} rows, layout `{s.get('format', 'unknown')}`"
             + (f", sha256 `{sha[:12]}…`" if sha else "") + "); their recorded logprobs stand for the inference side"]
    if s.get("prefill"):
        items.append("Engine prefill: every sequence re-scored by the engine in one prefill (`logprob_prefill`)")
    if s.get("temperature") is not None:
        items.append(f"Sampling temperature tested: `{s['temperature']}`")
    return items


def recorded_section(run: RunData) -> list:
    """What the run saw: the three-way split and, when the recording is far from both, the likely cause."""
    from ..rollouts.causes import CAUSES

    row = row_of(run.summary, None)
    blocks: list = [Heading("What the run saw")]
    gap = row.get("rollout_vs_train_mean_abs_dlogp", row.get("mean_abs_dlogp"))
    text = (f"The logprobs the run recorded differ from the training stack's by {_num(gap)} nats per response token "
            "on average: that is the gap its importance ratios corrected.")
    prefill, engine = row.get("rollout_vs_prefill_mean_abs_dlogp"), row.get("prefill_vs_train_mean_abs_dlogp")
    if prefill is not None and not pd.isna(prefill):
        text += (f" The engine's prefill of the same sequences is {_num(engine)} nats from the trainer (the engine's "
                 f"numerics) and {_num(prefill)} nats from the recording (the decode path, or the recording itself).")
        dominant = str(row.get("dominant_factor"))
        if dominant in FACTORS:
            text += (f" Of the ratio π_train/π_recorded = π_train/π_prefill × π_prefill/π_recorded, the larger factor "
                     f"is {FACTORS[dominant]} (signed mean log {_num(row[dominant + '_mean_dlogp'])} nats).")
    else:
        text += (" Without `--infer vllm` the gap cannot be split into the engine's numerics and the decode path; "
                 "score the file again with it to see the split.")
    blocks.append(Paragraph(text))
    far, bound = str(row.get("recorded_far", "")).lower() in ("true", "1"), row.get("far_bound")
    cause = row.get("likely_cause")
    cause = "" if cause is None or pd.isna(cause) else str(cause)
    if not far:
        near = "the trainer" if gap is not None and not pd.isna(gap) and gap <= bound else "the engine's prefill"
        blocks.append(Paragraph(f"The recording is within {_num(bound)} nats of {near}: numerics of two correct "
                                "stacks, not a loading, sampling or weights problem."))
    else:
        blocks.append(Paragraph(f"The recording is farther than {_num(bound)} nats from the trainer, more than two "
                                "correct stacks' numerics explain. Likely cause (a flag, not a verdict): "
                                + (f"{_code(cause)}: {CAUSES[cause]}." if cause in CAUSES else "none named.")))
    return blocks
