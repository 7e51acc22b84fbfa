"""An engine's outputs kept for the trainer: --placement alternate, where the engine runs every prompt and leaves the
device before the trainer loads on it.

    kept = KeptOutputs(folder=None)                     # host memory; a folder: one chunk file per engine call
    recording = Recording(engine, kept)                 # the engine pass: each call's outputs copied to the host
    ... runs/alternate.py makes the calls compare will make ...
    engine = KeptEngine(kept, info, device)             # the trainer pass: the same calls answered from `kept`

A call is known by what it was asked (method, the sequences' ids and tokens, the taps, the sampling), and the same call
asked again is answered with its next recording, in order: the trainer pass gets every tap, logit and logprob the
engine handed over, as the engine handed them over (its tap order and stacking, on the device it used), so the
pairing, the reduction and the scores downstream are the ones a run with both stacks together computes. A trainer
pass reads the recordings without using them up: an ablation's trainer-side combinations each read the same ones.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import torch

from ..errors import StackError
from ..prompts import Prompt
from .protocol import Capabilities, PromptScores, ScoresSink, StackInfo, TapSink


def _call_key(method: str, prompts: Sequence[Prompt], taps=frozenset(), extra=None) -> tuple:
    return (method, tuple((p.prompt_id, tuple(p.token_ids)) for p in prompts), tuple(sorted(taps)), extra)


def _host(x: torch.Tensor) -> tuple[torch.Tensor, str]:
    """A copy on the host (the engine's tensor is valid until its next call), and the device to hand it back on."""
    return x.detach().to("cpu", copy=True), str(x.device)


def _scores_on_host(scores) -> tuple:
    """A PromptScores or SequenceScores with its tensors copied to the host, and their devices."""
    devices, changes = {}, {}
    for f in dataclasses.fields(scores):
        value = getattr(scores, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name], devices[f.name] = _host(value)
    return dataclasses.replace(scores, **changes), devices


def _scores_back(kept: tuple):
    scores, devices = kept
    return dataclasses.replace(scores, **{name: getattr(scores, name).to(device) for name, device in devices.items()})


def _nbytes(entry: dict) -> int:
    total = sum(x.numel() * x.element_size() for _, _, x, _ in entry.get("taps", ()))
    for scores, devices in entry.get("scores", ()):
        total += sum(getattr(scores, name).numel() * getattr(scores, name).element_size() for name in devices)
    return total


class KeptOutputs:
    """Every recorded call of one engine pass, in host memory or (`folder`) one torch.save chunk per call there."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self._calls: dict[tuple, list] = defaultdict(list)  # key -> entries (dicts), or their chunk files
        self.bytes = 0  # of the tensors kept
        self.chunks = 0

    def put(self, key: tuple, entry: dict) -> None:
        self.bytes += _nbytes(entry)
        if self.folder is None:
            self._calls[key].append(entry)
            return
        path = self.folder / f"chunk-{self.chunks:06d}.pt"
        torch.save(entry, path)
        self.chunks += 1
        self._calls[key].append(path)

    def get(self, key: tuple, index: int) -> dict:
        recorded = self._calls.get(key, [])
        if index >= len(recorded):
            raise StackError(f"the engine pass did not record the call {key[0]} of sequences "
                             f"{[p for p, _ in key[1]][:8]} (call {index + 1}); report this as a bug")
        entry = recorded[index]
        return torch.load(entry, weights_only=False) if isinstance(entry, Path) else entry

    def close(self, keep: bool = False) -> None:
        """Drop what is kept; the chunk files too, unless `keep`."""
        self._calls.clear()
        if self.folder is not None and not keep:
            shutil.rmtree(self.folder, ignore_errors=True)


class Recording:
    """The engine of an engine pass: every call passes through, and its outputs are copied into `kept`."""

    def __init__(self, engine, kept: KeptOutputs) -> None:
        self.engine, self.kept = engine, kept
        self.name = engine.name

    def capabilities(self) -> Capabilities:
        return self.engine.capabilities()

    def load(self, settings) -> None:
        """The engine belongs to the caller, who loaded it."""

    def begin_run(self) -> None:
        self.engine.begin_run()

    def info(self) -> StackInfo:
        return self.engine.info()

    def close(self) -> None:
        """The engine belongs to the caller."""

    def batch_groups(self, prompts: Sequence[Prompt]) -> list[list[Prompt]]:
        groups = self.engine.batch_groups(prompts)
        self.kept.put(_call_key("batch_groups", prompts), {"groups": [[p.prompt_id for p in g] for g in groups]})
        return groups

    def _recorded(self, key: tuple, call, sink: TapSink | None):
        handed = []

        def keep(seq_id, tap, x):
            handed.append((seq_id, tap, *_host(x)))
            if sink is not None:
                sink(seq_id, tap, x)

        scores = call(keep)
        self.kept.put(key, {"taps": handed, "scores": [_scores_on_host(s) for s in scores]})
        return scores

    def score(self, prompts, taps: frozenset[str], sink: TapSink, on_scored: ScoresSink | None = None
              ) -> list[PromptScores]:
        scores = self._recorded(_call_key("score", prompts, taps), lambda keep: self.engine.score(prompts, taps, keep),
                                sink)
        return _delivered(scores, on_scored)

    def score_batched(self, prompts, taps: frozenset[str] = frozenset(), sink: TapSink | None = None):
        return self._recorded(_call_key("score_batched", prompts, taps),
                              lambda keep: self.engine.score_batched(prompts, taps, keep), sink)

    def sample(self, prompts, spec, taps: frozenset[str], sink: TapSink):
        return self._recorded(_call_key("sample", prompts, taps, spec),
                              lambda keep: self.engine.sample(prompts, spec, taps, keep), sink)


class RecordingNoise:
    """--engine-noise's other-mode engines (runs/batch_invariance.NoiseEngines) in an engine pass: their scores kept
    in `kept` (set per pass) as the engine's are."""

    def __init__(self, engines) -> None:
        self.engines, self.kept = engines, None

    def score(self, settings, regions: Sequence[str], sequences: Sequence[Prompt]) -> list:
        scores = self.engines.score(settings, regions, sequences)
        self.kept.put(_call_key("noise", sequences, (), (settings, tuple(regions))),
                      {"scores": [_scores_on_host(s) for s in scores]})
        return scores

    def __len__(self) -> int:
        return len(self.engines)

    def close(self) -> None:
        self.engines.close()


class KeptEngine:
    """An engine pass's recordings as the inference stack of the trainer pass (the Stack protocol's calls)."""

    def __init__(self, kept: KeptOutputs, capabilities: Capabilities, info: StackInfo) -> None:
        self.kept, self._capabilities, self._info = kept, capabilities, info
        self.name = info.name
        self._next: dict[tuple, int] = defaultdict(int)  # this pass's reading position per call

    def _entry(self, key: tuple) -> dict:
        index = self._next[key]
        self._next[key] += 1
        return self.kept.get(key, index)

    def capabilities(self) -> Capabilities:
        return self._capabilities

    def load(self, settings) -> None:
        """Nothing loads: the engine ran before."""

    def begin_run(self) -> None:
        """The engine pass measured its run (its info) already."""

    def info(self) -> StackInfo:
        return copy.deepcopy(self._info)

    def close(self) -> None:
        """The recordings belong to the run that made them (KeptOutputs.close)."""

    def batch_groups(self, prompts: Sequence[Prompt]) -> list[list[Prompt]]:
        by_id = {p.prompt_id: p for p in prompts}
        return [[by_id[i] for i in group] for group in self._entry(_call_key("batch_groups", prompts))["groups"]]

    def _replayed(self, key: tuple, sink: TapSink | None) -> list:
        entry = self._entry(key)
        for seq_id, tap, x, device in entry["taps"]:
            if sink is not None:
                sink(seq_id, tap, x.to(device))
        return [_scores_back(s) for s in entry["scores"]]

    def score(self, prompts, taps: frozenset[str], sink: TapSink, on_scored: ScoresSink | None = None
              ) -> list[PromptScores]:
        return _delivered(self._replayed(_call_key("score", prompts, taps), sink), on_scored)

    def score_batched(self, prompts, taps: frozenset[str] = frozenset(), sink: TapSink | None = None):
        return self._replayed(_call_key("score_batched", prompts, taps), sink)

    def sample(self, prompts, spec, taps: frozenset[str], sink: TapSink):
        return self._replayed(_call_key("sample", prompts, taps, spec), sink)


class KeptNoise:
    """RecordingNoise's recordings, answering engine_noise in the trainer pass: no engine is built there."""

    def __init__(self, kept: KeptOutputs, builds: int) -> None:
        self.kept, self._builds = kept, builds
        self._next: dict[tuple, int] = defaultdict(int)

    def score(self, settings, regions: Sequence[str], sequences: Sequence[Prompt]) -> list:
        key = _call_key("noise", sequences, (), (settings, tuple(regions)))
        index = self._next[key]
        self._next[key] += 1
        return [_scores_back(s) for s in self.kept.get(key, index)["scores"]]

    def __len__(self) -> int:
        return self._builds

    def close(self) -> None:
        """Its engines were closed after the engine pass."""


def _delivered(scores: list, on_scored: ScoresSink | None) -> list:
    if on_scored is None:
        return scores
    for s in scores:
        on_scored(s)
    return []
