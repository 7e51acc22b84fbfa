"""A toy stack and a toy region, pure torch, for testing orchestration, reports and the CLI without an engine.

Registered only by tests (conftest `toy` fixture) through the same registries as the real ones, which is the
proof that a new stack or region is one file plus one registry line. The toy model reads the checkpoint's
config (layers, vocabulary) and computes, per layer, h <- h + tanh(h @ W) with seeded weights. Two variants
round differently: `toy` rounds the layer's product and its sum separately (2 R), `toy-fused` keeps the layer in
FP32 and rounds once, so the two disagree in BF16 like two real stacks do; the region `toy-align` makes `toy`
round once too, after which the two agree bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from divergence_probe.regions.base import Region
from divergence_probe.engines.protocol import CAPTURED, Capabilities, PromptScores, SequenceScores, StackInfo, StackPolicy
from divergence_probe.engines.hooks import Replacement
from divergence_probe.models import get_family
from divergence_probe.taps import ALL_TAPS, TapKey

WIDTH = 16


class ToyLayer(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, fused: bool) -> None:
        super().__init__()
        self.weight, self.fused = torch.nn.Parameter(weight, requires_grad=False), fused

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return (h.float() + torch.tanh(h.float() @ self.weight.float())).to(h.dtype)
        return h + torch.tanh(h @ self.weight)


class ToyModel(torch.nn.Module):
    def __init__(self, layers: int, vocab: int, dtype: torch.dtype, seed: int, fused: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter((torch.randn(vocab, WIDTH, generator=g)).to(dtype), requires_grad=False)
        self.layers = torch.nn.ModuleList(
            ToyLayer((torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5).to(dtype), fused) for _ in range(layers))
        self.head = torch.nn.Parameter((torch.randn(WIDTH, vocab, generator=g) * 2).to(dtype), requires_grad=False)


class ToyStack(StackPolicy):
    name = "toy"
    sides = ("infer", "train")
    fused = False
    patches = "toy_stack:TOY_PATCHES"  # both toy stacks' region patches
    aligns = ("toy-align",)  # TOY_PATCHES

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 1) -> Capabilities:
        """Every tap, patched in place; none of the optional roles (no routes, no grafting)."""
        return Capabilities(taps={name: CAPTURED for name in ALL_TAPS})

    def capabilities(self) -> Capabilities:
        return self.declare()

    def begin_run(self) -> None:
        pass

    def load(self, settings) -> None:
        config = json.loads((Path(settings.model_path) / "config.json").read_text())
        self.settings = settings
        self.layer_taps = get_family(config["model_type"]).layer_taps
        self.model = ToyModel(config["num_hidden_layers"], config["vocab_size"], settings.dtype, settings.seed,
                              self.fused)

    def _forward(self, ids, emit=None) -> torch.Tensor:
        """[T] ids -> [T, V] logits; emit(key, [T, WIDTH]) for every tap of the selection."""
        h = self.model.embed[torch.tensor(ids)]
        emit and emit(TapKey.of("embed", -1), h)
        for i, layer in enumerate(self.model.layers):
            h = layer(h)
            for name in self.layer_taps:
                emit and emit(TapKey.of(name, i), h)
        n = len(self.model.layers)
        emit and emit(TapKey.of("final_norm", n), h)
        logits = h @ self.model.head
        emit and emit(TapKey.of("logits", n), logits[:-1])
        return logits

    def _scores(self, key: int, ids, emit=None) -> PromptScores:
        logits = self._forward(ids, emit)[:-1]
        logprobs = logits.float().log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        return PromptScores(key, logits, logprobs)

    def score(self, prompts, taps, sink, on_scored=None):
        results = []
        for p in prompts:
            emit = (lambda key, x, pid=p.prompt_id: key.name in taps and sink(pid, key, x)) if taps else None
            (on_scored or results.append)(self._scores(p.prompt_id, p.token_ids, emit))
        return results

    def score_batched(self, prompts, taps=frozenset(), sink=None):
        return self.score(prompts, taps, sink)

    def batch_groups(self, prompts):
        return [list(prompts)]

    def sample(self, prompts, spec, taps, sink):
        results = []
        for p in prompts:
            for k in range(spec.samples_per_prompt):
                g = torch.Generator().manual_seed(spec.request_seed(p.prompt_id, k))
                ids = list(p.token_ids)
                for _ in range(spec.max_new_tokens):
                    probs = self._forward(ids)[-1].float().softmax(-1)
                    ids.append(int(torch.multinomial(probs, 1, generator=g)))
                seq_id = len(results)
                fed = ids[:-1]  # like an engine: the last sample is never fed back
                emit = (lambda key, x, sid=seq_id: key.name in taps and sink(sid, key, x[: len(fed)])) if taps else None
                scores = self._scores(seq_id, ids, emit)
                results.append(SequenceScores(seq_id, p.prompt_id, k, tuple(ids), len(p.token_ids), scores.logits,
                                              scores.logprobs))
        return results

    def info(self) -> StackInfo:
        return StackInfo(name=self.name, versions={"torch": torch.__version__},
                         implementations={"layer": "FP32, one rounding" if self.model.layers[0].fused else "2 R"})

    def close(self) -> None:
        self.model = None


class FusedToyStack(ToyStack):
    name = "toy-fused"
    fused = True


def _align_toy(model: torch.nn.Module) -> list[Replacement]:
    return [Replacement(layer, "fused", True) for layer in model.layers]


TOY_ALIGN = Region(name="toy-align", summary="toy layer: FP32, one rounding")
TOY_PATCHES = {"toy-align": _align_toy}
