"""score without a model: a rollout file that records both sides of the ratio per token (the engine's logprob and
the trainer's, rollouts/columns.py) is measured from the file alone. No stack loads, so it works for a 235B run
on a laptop; the full-vocabulary KL needs logits neither side recorded and is NaN (the sampled-token estimators
k1, k2, k3 stand in for it).

    run = paired_run(read_rollouts("step_12.parquet"))   # verl: rollout_log_probs beside old_log_probs
    run.write("runs/step12")
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..numerics.tables import ROLLOUT_TOKEN_COLUMNS
from ..prompts import Prompt
from ..rollouts.record import RolloutBatch, RolloutError
from .manifest import build_manifest
from .scored import FAR_FACTOR, FAR_FLOOR, ScoreRun, numbered

# What manifest.json's score.trainer says of a run scored from the file's own trainer column.
RECORDED_TRAINER = "recorded"


def paired_run(batch: RolloutBatch, clip_eps: float, tis_cap: float) -> ScoreRun:
    """The file's engine logprobs against its trainer logprobs, as score's files (tokens.csv, summary.csv,
    buckets.csv); token strings and prompt texts are empty (no tokenizer is loaded)."""
    if not batch.has_train:
        raise RolloutError(f"{batch.path} records no trainer logprobs beside the engine's; pass --model to score it "
                           "with the training stack, or name the trainer's column with --fields train=COL")
    ids = numbered(batch)
    prompts: dict[int, Prompt] = {}
    for r, (pid, _) in zip(batch.rollouts, ids):
        prompts.setdefault(pid, Prompt(pid, f"{batch.path.name} row {r.row}", "", r.prompt_ids))
    manifest = build_manifest("score", {}, {"score": {
        "rollouts": str(batch.path), "rollouts_sha256": batch.sha256, "format": batch.format,
        "n_rollouts": len(batch.rollouts), "prefill": False, "temperature": None, "trainer": RECORDED_TRAINER,
        "step": batch.step, "clip_eps": clip_eps, "tis_cap": tis_cap, "far_factor": FAR_FACTOR,
        "far_floor": FAR_FLOOR, "routed_experts_recorded": sum(r.routed_experts is not None for r in batch.rollouts),
        "logprobs": "recorded: the engine's and the trainer's, as the file holds them; kl: NaN (no logits)"}})
    return ScoreRun(batch, list(prompts.values()), [], None, manifest, clip_eps, tis_cap, table=_table(batch, ids))


def _table(batch: RolloutBatch, ids: list[tuple[int, int]]) -> pd.DataFrame:
    """The tokens table of every response token, as tokens_frame makes it of TokenScores (no prefill, no KL, no
    token strings), built as arrays: an object per token would be most of a large file's memory."""
    lengths = np.array([len(r.response_ids) for r in batch.rollouts], dtype=np.int64)
    starts = np.array([len(r.prompt_ids) for r in batch.rollouts], dtype=np.int64)
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)  # each token's row's first token, in the table
    n = int(lengths.sum())

    def flat(name: str, dtype) -> np.ndarray:
        return np.fromiter((v for r in batch.rollouts for v in getattr(r, name)), dtype, count=n)

    infer, train = flat("logprobs", np.float64), flat("train_logprobs", np.float64)
    columns = {
        "prompt_id": np.repeat([pid for pid, _ in ids], lengths), "sample_id": np.repeat([sid for _, sid in ids], lengths),
        "position": np.repeat(starts, lengths) + np.arange(n) - first, "token_id": flat("response_ids", np.int64),
        "token": pd.Series("", index=range(n), dtype=str), "is_response": np.ones(n, bool),
        "logprob_infer": infer, "logprob_train": train, "delta_logprob": train - infer, "kl": np.full(n, math.nan)}
    return pd.DataFrame({c: columns[c] for c in ROLLOUT_TOKEN_COLUMNS if c in columns})
