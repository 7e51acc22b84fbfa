"""The second engine as a stack: the Stack protocol (engines/protocol.py) over model.py, on the inference side, and
its pre-load policy (StackClass): StackPolicy's defaults (no engine args, knobs or kernel sets, one process, no worker),
its region patches (patches.py) and its refusal of a model it cannot run.

It scores prompts one per forward (`score`) and as right-padded batches of --batch-tokens (`score_batched`, the
batch-invariance floor), hands every dense tap to the run's sink, takes its regions in place (patches.py) and declares
what it does not do, so the spec refuses it in one line before anything loads: it samples nothing (--mode generate)
and runs no op of its own on another stack's inputs (--graft, --depth).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from divergence_probe.engines.protocol import (CAPTURED, Capabilities, PromptScores, SamplingSpec, ScoresSink,
                                               SequenceScores, StackInfo, StackPolicy, StackSettings, TapSink)
from divergence_probe.errors import StackError
from divergence_probe.models import get_family
from divergence_probe.numerics.metrics import token_logprobs
from divergence_probe.prompts import Prompt, padded_batches
from divergence_probe.taps import ALL_TAPS

from .model import Model

NAME = "second"
DENSE_ONLY = f"not captured: the {NAME} engine runs dense models, which have no router"
SAMPLES_NOTHING = f"--mode generate samples responses, which the {NAME} engine does not; use --mode prefill"
NO_GRAFT = (f"--graft/--depth run the trainer's ops on the engine's per-op inputs, which the {NAME} engine does not "
            "hand over; drop them")


class SecondStack(StackPolicy):
    name = NAME
    title = "the second engine"
    patches = f"{__package__}.patches:PATCHES"
    aligns = ("swiglu",)  # patches.py: PATCHES
    sides = ("infer",)  # an engine: it runs no trainer's forward (protocol.Trainer)

    def __init__(self) -> None:
        self.model: Model | None = None
        self.settings: StackSettings | None = None

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 1) -> Capabilities:
        return Capabilities(taps={tap: DENSE_ONLY if tap == "router_logits" else CAPTURED for tap in ALL_TAPS},
                            refused={"--mode generate": SAMPLES_NOTHING, "--graft": NO_GRAFT, "--depth": NO_GRAFT})

    def capabilities(self) -> Capabilities:
        return self.declare()

    @classmethod
    def check_model(cls, settings: StackSettings, config: dict) -> None:
        if get_family(config["model_type"]).top_k_field is not None:
            raise StackError(f"the {NAME} engine runs dense models, and {config['model_type']} is a mixture of "
                             "experts; use --infer vllm or hf")

    def load(self, settings: StackSettings) -> None:
        config = json.loads((Path(settings.model_path) / "config.json").read_text())
        self.check_model(settings, config)
        self.settings = settings
        self.model = Model.load(settings.model_path, config, settings.dtype, settings.device)

    def begin_run(self) -> None:
        """Nothing of a run is kept between runs."""

    def _forward(self, prompts: Sequence[Prompt], taps: frozenset[str], sink: TapSink | None) -> list[PromptScores]:
        """One forward of the prompts, right-padded; their scores in order, each prompt's taps handed to `sink`."""
        lengths = [len(p.token_ids) for p in prompts]
        ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, : lengths[row]] = torch.tensor(p.token_ids)
        ids = ids.to(self.settings.device)

        def emit(row, key, x):
            if key.name in taps:
                sink(prompts[row].prompt_id, key, x)

        with torch.inference_mode():
            logits = self.model(ids, lengths, emit if taps and sink is not None else None)
        return [PromptScores(p.prompt_id, logits[row, : n - 1], token_logprobs(logits[row, : n - 1], ids[row, 1:n]))
                for row, (p, n) in enumerate(zip(prompts, lengths))]

    def score(self, prompts: Sequence[Prompt], taps: frozenset[str], sink: TapSink,
              on_scored: ScoresSink | None = None) -> list[PromptScores]:
        results = []
        for prompt in prompts:
            [scores] = self._forward([prompt], taps, sink)
            (on_scored or results.append)(scores)
        return results

    def score_batched(self, prompts: Sequence[Prompt], taps: frozenset[str] = frozenset(),
                      sink: TapSink | None = None) -> list[PromptScores]:
        return [s for group in self.batch_groups(prompts) for s in self._forward(group, taps, sink)]

    def batch_groups(self, prompts: Sequence[Prompt]) -> list[list[Prompt]]:
        return list(padded_batches(prompts, self.settings.batch_tokens))

    def sample(self, prompts: Sequence[Prompt], spec: SamplingSpec, taps: frozenset[str],
               sink: TapSink) -> list[SequenceScores]:
        raise StackError(SAMPLES_NOTHING)

    def info(self) -> StackInfo:
        return StackInfo(name=NAME, versions={"torch": torch.__version__},
                         implementations={"rmsnorm": "FP32 normalise, round, weight in the run's dtype (2 R)",
                                          "rope": "FP32 rotation, one rounding", "attention": "torch SDPA, masked",
                                          "swiglu": f"{self.model.layers[0].act.__module__}."
                                                    f"{self.model.layers[0].act.__name__}"},
                         settings={"batch": "one prompt per forward; score_batched: right-padded batches",
                                   "device": self.settings.device})

    def close(self) -> None:
        self.model = None
