"""The RolloutEngine protocol: what an RL loop needs from an inference engine it trains against.

An RL loop samples through the engine, pushes the trainer's weights into it while it runs, and must be able to prove
that the engine then computes with exactly those weights and serves nothing computed before the push. The loop never
reaches into the engine's library for any of it: it asks the engine through these methods, so another engine is
another implementation of this protocol, not another branch of the loop.

A weight sync has a lifetime: `start_weight_sync` begins it (the engine's weights are then the checkpoint's), each
`push_weights` is followed by `prove_push` (the device comparison), and the push counts as proven fresh only once an
engine call has scored the stale-cache probe: the next `rollout` carries it, or `prove_cache` scores it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

if TYPE_CHECKING:  # annotations only: importing the protocol needs no torch
    import torch


@dataclass(frozen=True)
class RolloutSample:
    """One sequence to sample: its prompt's token ids and how to sample it (a per-sequence seed, so a rollout is
    reproducible whatever batch it shares an engine step with)."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float
    seed: int


@dataclass
class Rolled:
    """One sampled sequence: the response's token ids, the engine's logprob of each, and (when asked for) the experts
    the engine's router sent each of its fed rows to ([rows, layers, k]; prompt and response, all but the last
    token)."""

    tokens: tuple[int, ...]
    logprobs: list[float]
    routes: torch.Tensor | None = None


@dataclass
class SyncCheck:
    """What proving a push found: how many engine tensors were compared, and how many differ from the previous
    proof's (0 on the first)."""

    tensors: int
    changed: int


class RolloutEngine(Protocol):
    @property
    def prefix_caching(self) -> bool:
        """Whether the engine caches KV blocks across requests (as production rollouts run)."""

    def check_routes_recordable(self) -> None:
        """Refuse now, in one line, an engine whose rollouts cannot record their routes (a mixture of experts)."""

    def start_weight_sync(self, tied_head: bool, vocab_size: int) -> None:
        """Begin a weight sync on the engine as loaded (its weights are the checkpoint's); `tied_head`: whether the
        model's head is its embedding; `vocab_size`: the token ids the stale-cache probe may draw from."""

    def rollout(self, samples: Sequence[RolloutSample], *, routes: bool = False) -> list[Rolled]:
        """Sample every sequence in one engine call, in order; a push not yet proven fresh rides the call (its
        stale-cache probe), and a stale cache raises StaleCacheError before anything sampled is returned."""

    def push_weights(self, weights: Mapping[str, torch.Tensor]) -> float:
        """Load the trainer's tensors (by checkpoint name) into the running engine and drop every KV block computed
        before; SyncError when the previous push was never proven fresh. Returns the seconds the stale-cache probe's
        positive control took (before the push: part of the check's cost, not the push's)."""

    @property
    def push_unproven(self) -> bool:
        """Whether a push happened that no engine call has proven fresh yet."""

    @property
    def probe_moved(self) -> bool | None:
        """Whether the last proof's probe score moved from the one before (reported, not required)."""

    def prove_push(self, weights: Mapping[str, torch.Tensor], audit: bool = False) -> SyncCheck:
        """SyncError naming the first engine tensor that is not the trainer's (`audit`: compared on the host by sha256
        too); else what was compared."""

    def prove_cache(self) -> None:
        """Prove the last push fresh by scoring the stale-cache probe alone: for a push no rollout follows."""
