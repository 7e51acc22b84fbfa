"""RecordedStack: the logprobs a user's RL run recorded for its responses, as the inference side of the run loop.

`score` is a comparison whose engine is a file: the run loop asks this stack for a batch's scores as it asks an
engine, and the training stack scores the same sequences. A file holds the logprob of each sampled response token
and nothing else, so the stack declares no taps, no logits (the full-distribution KL needs an engine beside it) and
refuses every feature that would run a model.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..protocol import (ENGINE_REGIONS, Capabilities, PromptScores, SamplingSpec, ScoresSink, SequenceScores,
                        StackInfo, StackPolicy, StackSettings, TapSink)
from ...errors import StackError
from ...prompts import Prompt
from ...taps import ALL_TAPS

NOT_CAPTURED = "not captured: recorded rollouts hold logprobs only"
REFUSED = ("--graft", "--depth", "ablate", "--mode generate", "--batch-invariance", "rl", ENGINE_REGIONS)


class RecordedStack(StackPolicy):
    """The recorded response logprobs of each sequence, by prompt id: `recorded[prompt_id]` holds one logprob per
    response token, the sequence's last tokens. A prompt position has none (NaN): the run never sampled it."""

    name = "recorded"

    def __init__(self, recorded: Mapping[int, Sequence[float]] | None = None) -> None:
        self.recorded = dict(recorded or {})

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 1) -> Capabilities:
        return Capabilities(taps={tap: NOT_CAPTURED for tap in ALL_TAPS}, logits=False,
                            refused={feature: f"{feature} runs a model, and recorded rollouts hold logprobs only"
                                     for feature in REFUSED})

    def capabilities(self) -> Capabilities:
        return self.declare()

    def load(self, settings: StackSettings) -> None:
        """Nothing to load: the logprobs were read with the file."""

    def score(self, prompts: Sequence[Prompt], taps: frozenset[str], sink: TapSink,
              on_scored: ScoresSink | None = None) -> list[PromptScores]:
        """Each sequence's recorded logprobs at scored positions 1..T-1 (float64: the file's values exactly), no
        logits."""
        if taps:
            raise StackError(f"recorded rollouts hold no taps ({', '.join(sorted(taps))}): {NOT_CAPTURED}")
        scores = []
        for prompt in prompts:
            if prompt.prompt_id not in self.recorded:
                raise StackError(f"no logprobs were recorded for sequence {prompt.prompt_id}")
            recorded = self.recorded[prompt.prompt_id]
            logprobs = torch.full((len(prompt.token_ids) - 1,), torch.nan, dtype=torch.float64)
            if recorded:
                logprobs[-len(recorded):] = torch.tensor(recorded, dtype=torch.float64)
            scores.append(PromptScores(prompt.prompt_id, None, logprobs))
        if on_scored is None:
            return scores
        for s in scores:
            on_scored(s)
        return []

    def score_batched(self, prompts: Sequence[Prompt], taps: frozenset[str] = frozenset(),
                      sink: TapSink | None = None) -> list[PromptScores]:
        """Refused as declared: a file was batched by no one, so it has no batch-invariance floor to measure."""
        raise StackError(self.declare().refused["--batch-invariance"])

    def batch_groups(self, prompts: Sequence[Prompt]) -> list[list[Prompt]]:
        raise StackError(self.declare().refused["--batch-invariance"])

    def sample(self, prompts: Sequence[Prompt], spec: SamplingSpec, taps: frozenset[str],
               sink: TapSink) -> list[SequenceScores]:
        """Refused as declared: the file's responses were sampled by the user's run, not here."""
        raise StackError(self.declare().refused["--mode generate"])

    def info(self) -> StackInfo:
        return StackInfo(self.name)

    def begin_run(self) -> None:
        """Nothing a run measures starts over: the file is what it is."""

    def close(self) -> None:
        self.recorded = {}
