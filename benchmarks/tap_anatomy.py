"""Where the cost of taps goes: the compare loop run with its parts switched on one at a time.

Configurations (each `compare.score_both`, the loop of `compare.run_compare`, token scoring included, timed to a
device sync):
  none            no taps
  infer hooks     the inference stack captures every tap into a sink that drops it; no training taps
  train hooks     the same on the training stack only
  both hooks      both stacks capture, both sinks drop
  pairing         both capture into TapPairing, which stacks each prompt's pairs but does not reduce them
  all             everything: what `compare --taps all` does
Differences between rows attribute the overhead: hooks and copies per stack, filing and stacking, the reduction.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch

import divergence_probe.runs.capture as capture
from divergence_probe.runs.capture import TapPairing
from divergence_probe.runs.compare import PendingScores, SequenceSource, capturable_taps, score_both
from divergence_probe.taps import expected_taps

CONFIGS = ("none", "infer hooks", "train hooks", "both hooks", "pairing", "all")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def _no_reduction():
    """Stacks still happen (their inputs are built), the fused kernel does not run."""
    real = capture.fused_diff_sums
    capture.fused_diff_sums = lambda tests, refs: torch.zeros(sum(map(len, tests)), 7, dtype=torch.float64,
                                                              device=tests[0].device)
    try:
        yield
    finally:
        capture.fused_diff_sums = real


class _Dropped:
    """Taps go nowhere: the hooks and copies run, filing and reducing do not."""

    def park(self, *_) -> None: ...

    def add_sequences(self, *_) -> None: ...

    def pair(self, *_) -> None: ...

    def finish_prompt(self, *_) -> None: ...


def _loop(probe, prompts, config: str) -> None:
    everything, _ = capturable_taps(probe, probe._spec("compare", None, {"taps": "all"}))  # a compiled engine: fewer
    infer_taps = everything if config in ("infer hooks", "both hooks", "pairing", "all") else frozenset()
    train_taps = everything if config in ("train hooks", "both hooks", "pairing", "all") else frozenset()
    pairs = config in ("pairing", "all")
    pairing = TapPairing(expected_taps(everything, probe.source.num_layers, probe.source.family.layer_taps))
    score_both(probe, prompts, SequenceSource(), infer_taps, train_taps, pairing if pairs else _Dropped(),
               PendingScores.read)
    if pairs:
        pairing.stats  # the read-back


def anatomy(probe, prompts, rounds: int = 2) -> dict:
    """Fastest seconds of each configuration over `rounds` interleaved rounds (after one warm-up of each)."""
    best = {}
    for rnd in range(rounds + 1):
        for config in CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]:
            with _no_reduction() if config == "pairing" else nullcontext():
                _sync()
                start = time.perf_counter()
                _loop(probe, prompts, config)
                _sync()
                seconds = time.perf_counter() - start
            if rnd:  # round 0 warms up
                best[config] = min(best.get(config, seconds), seconds)
    return {config: round(best[config], 4) for config in CONFIGS}
