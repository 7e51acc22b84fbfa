"""What a score run holds: the scored tokens of the recorded rollouts, with the three-way split of their mismatch
and the explanation that fits when the recording is far from both stacks (shared by score and its model-free
paired variant)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

from ..numerics.rl_metrics import bucket_table, ratio_split, sequence_metrics, token_metrics
from ..numerics.tables import summary_of, tokens_frame
from ..prompts import Prompt
from ..rollouts.record import RolloutBatch


@dataclass(slots=True)
class TokenScore:
    """One scored token: both logprobs of the actual token and the full-vocabulary KL. In generate mode a token
    also belongs to a sample, and is either part of the prompt or of the sampled response. Slotted: a run holds one
    per scored token, so a per-instance dict would be most of a large run's memory."""

    prompt_id: int
    position: int
    token_id: int
    token: str
    logprob_infer: float
    logprob_train: float
    kl: float
    sample_id: int | None = None
    is_response: bool | None = None
    logprob_prefill: float | None = None  # generate mode: the engine's prefill of the whole sampled sequence



# The recorded logprobs are "far" when their mean |Δ| to the trainer is this many times the engine's own gap to the
# trainer on the same sequences (prefill, --infer vllm): numerics differences between two correct stacks are that
# gap's size, so ten times it is something else. Without a prefill, at least FAR_FLOOR nats per token: numerics
# alone move a BF16 logprob by a small fraction of that.
FAR_FACTOR = 10.0
FAR_FLOOR = 0.1
# "wrong tokens": tokens the model gives less than this probability (trainer, and engine prefill when measured)
# while the recording says otherwise; when they carry most of the gap, the recorded ids are not what was sampled.
UNLIKELY_LOGPROB = math.log(1e-4)
WRONG_TOKEN_SHARE = 0.5
# Sampling temperatures RL runs use, tested when --temperature is not given: a recording made at one of them by an
# engine that reports tempered logprobs is far from the trainer's raw ones, and close to the trainer's at that one.
FIT_TEMPERATURES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.1, 1.2, 1.3, 1.5, 2.0)


@dataclass
class ScoreRun:
    """The scored rollouts; `write` puts them on disk as generate mode's files."""

    batch: RolloutBatch
    prompts: list[Prompt]
    tokens: list[TokenScore]  # logprob_prefill: the engine's prefill logprob (--infer vllm), else None
    untempered: list[float] | None  # with --temperature: the trainer's raw logprob, in `tokens` order (tokens: at T)
    manifest: dict
    clip_eps: float
    tis_cap: float
    temperature: float | None = None
    fitted: dict[float, float] | None = None  # without --temperature: FIT_TEMPERATURES -> mean |recorded - trainer at T|
    table: pd.DataFrame | None = None  # the tokens as tokens_frame makes them, given in place of `tokens` (paired.py)

    @cached_property
    def responses_table(self) -> pd.DataFrame:
        """Every scored token, built once: summary, buckets and tokens.csv read the same frame (each rebuilt from the
        tokens would hold several copies of a large run at once)."""
        df = tokens_frame(self.tokens, sampled=True) if self.table is None else self.table
        df["response_position"] = df["position"] - df.groupby(["prompt_id", "sample_id"])["position"].transform("min")
        return df

    @property
    def tokens_table(self) -> pd.DataFrame:
        """tokens.csv: generate mode's response rows, `logprob_rollout` (from the file) for `logprob_infer`."""
        return self.responses_table.drop(columns="response_position").rename(
            columns={"logprob_infer": "logprob_rollout"})

    @property
    def summary(self) -> dict:
        responses = self.responses_table
        row = summary_of(responses["delta_logprob"].to_numpy(np.float64), responses["kl"].to_numpy(np.float64), {}, 0.0)
        for name in ("first_inexact", "first_over_threshold"):  # no taps: nothing to localise
            row.pop(name)
        row |= token_metrics(responses["logprob_infer"].to_numpy(), responses["logprob_train"].to_numpy(),
                             self.clip_eps, self.tis_cap)
        row |= sequence_metrics(responses, self.clip_eps)
        return row | self.diagnosis()

    def diagnosis(self) -> dict:
        """The three-way split (with the prefill, also as the factors of the ratio, rl_metrics.ratio_split) and, when
        the recorded logprobs are far from the trainer (and the engine's prefill), which explanation fits:
        `recorded_far` and `likely_cause` (temperature, wrong_tokens, stale_weights). The gap is the one the run's
        comparison makes (at --temperature when given); `temperature` is named when the trainer at another
        temperature is ten times closer to the recording: raw logprobs when --temperature was given, else the
        closest of FIT_TEMPERATURES (`fitted_temperature`)."""
        table = self.responses_table
        rec, train = table["logprob_infer"].to_numpy(np.float64), table["logprob_train"].to_numpy(np.float64)
        gap = np.abs(rec - train)
        out = {"rollout_vs_train_mean_abs_dlogp": float(gap.mean())}
        bound = FAR_FLOOR
        unlikely = train < UNLIKELY_LOGPROB
        if "logprob_prefill" in table:  # tokens_frame leaves the column out when no token has a prefill
            prefill = table["logprob_prefill"].to_numpy(np.float64)
            out["rollout_vs_prefill_mean_abs_dlogp"] = float(np.abs(rec - prefill).mean())
            out["prefill_vs_train_mean_abs_dlogp"] = engine_gap = float(np.abs(prefill - train).mean())
            # the ratio's factors: no decode of its own here, so prefill/recorded is prefill/decode × decode/recorded
            split = ratio_split({"train": train, "prefill": prefill, "recorded": rec})
            # their mean |log| are prefill_vs_train and rollout_vs_prefill above: not written twice
            out |= {k: v for k, v in split.items() if not k.endswith("_mean_abs_dlogp")}
            bound = max(FAR_FLOOR, FAR_FACTOR * engine_gap)
            unlikely &= prefill < UNLIKELY_LOGPROB
            far = out["rollout_vs_prefill_mean_abs_dlogp"] > bound and gap.mean() > bound
        else:
            far = gap.mean() > bound
        out["far_bound"] = bound
        out["recorded_far"] = bool(far)
        wrong_share = float(gap[unlikely & (rec > train)].sum() / gap.sum()) if gap.sum() else 0.0
        out["wrong_token_share"] = wrong_share
        cause, other = "", None
        if self.untempered is not None:
            out["tempered_mean_abs_dlogp"] = float(gap.mean())
            out["untempered_mean_abs_dlogp"] = other = float(np.abs(rec - np.array(self.untempered)).mean())
        elif self.fitted:
            out["fitted_temperature"] = best = min(self.fitted, key=self.fitted.get)
            out["tempered_mean_abs_dlogp"] = other = self.fitted[best]
        if far:
            if other is not None and other * FAR_FACTOR < gap.mean():
                cause = "temperature"
            elif wrong_share > WRONG_TOKEN_SHARE:
                cause = "wrong_tokens"
            else:
                cause = "stale_weights"
        out["likely_cause"] = cause
        return out

    @property
    def buckets_table(self) -> pd.DataFrame:
        return bucket_table(self.responses_table, self.clip_eps, self.tis_cap)

    def files(self) -> dict[str, pd.DataFrame]:
        return {"tokens.csv": self.tokens_table, "summary.csv": pd.DataFrame([self.summary]),
                "buckets.csv": self.buckets_table}

    def write(self, out_dir: str | Path) -> Path:
        from ..rundir import write_run

        return write_run(Path(out_dir), self.manifest, self.prompts, self.files())




def numbered(batch: RolloutBatch) -> list[tuple[int, int]]:
    """(prompt_id, sample_id) per rollout: prompts numbered by their group's first row, samples by order in it."""
    groups: dict = {}
    seen: dict[int, int] = {}
    ids = []
    for r in batch.rollouts:
        key = ("row", r.row) if r.group is None else ("group", repr(r.group))
        pid = groups.setdefault(key, len(groups))
        ids.append((pid, seen.get(pid, 0)))
        seen[pid] = seen.get(pid, 0) + 1
    return ids
