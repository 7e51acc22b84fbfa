"""score without a model: a rollout file that records both sides of the ratio per token (the engine's logprob and
the trainer's, rollouts/columns.py) is measured from the file alone. No stack loads, so it works for a 235B run
on a laptop; the full-vocabulary KL needs logits neither side recorded and is NaN (the sampled-token estimators
k1, k2, k3 stand in for it).

    run = paired_run(read_rollouts("step_12.parquet"))   # verl: rollout_log_probs beside old_log_probs
    run.write("runs/step12")
"""

from __future__ import annotations

import math

from ..prompts import Prompt
from ..rollouts import RolloutBatch, RolloutError
from .manifest import build_manifest
from .scored import FAR_FACTOR, FAR_FLOOR, ScoreRun, TokenScore, numbered

# What manifest.json's score.trainer says of a run scored from the file's own trainer column.
RECORDED_TRAINER = "recorded"


def paired_run(batch: RolloutBatch, clip_eps: float, tis_cap: float) -> ScoreRun:
    """The file's engine logprobs against its trainer logprobs, as score's files (tokens.csv, summary.csv,
    buckets.csv); token strings and prompt texts are empty (no tokenizer is loaded)."""
    if not batch.has_train:
        raise RolloutError(f"{batch.path} records no trainer logprobs beside the engine's; pass --model to score it "
                           "with the training stack, or name the trainer's column with --fields train=COL")
    ids = numbered(batch)
    tokens: list[TokenScore] = []
    prompts: dict[int, Prompt] = {}
    for r, (pid, sid) in zip(batch.rollouts, ids):
        prompts.setdefault(pid, Prompt(pid, f"{batch.path.name} row {r.row}", "", r.prompt_ids))
        tokens.extend(TokenScore(pid, len(r.prompt_ids) + j, tok, "", r.logprobs[j], r.train_logprobs[j], math.nan,
                                 sid, True, None) for j, tok in enumerate(r.response_ids))
    manifest = build_manifest("score", {}, {"score": {
        "rollouts": str(batch.path), "rollouts_sha256": batch.sha256, "format": batch.format,
        "n_rollouts": len(batch.rollouts), "prefill": False, "temperature": None, "trainer": RECORDED_TRAINER,
        "step": batch.step, "clip_eps": clip_eps, "tis_cap": tis_cap, "far_factor": FAR_FACTOR,
        "far_floor": FAR_FLOOR, "routed_experts_recorded": sum(r.routed_experts is not None for r in batch.rollouts),
        "logprobs": "recorded: the engine's and the trainer's, as the file holds them; kl: NaN (no logits)"}})
    return ScoreRun(batch, list(prompts.values()), tokens, None, manifest, clip_eps, tis_cap)
