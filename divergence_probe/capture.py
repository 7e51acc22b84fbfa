"""Pair the two stacks' taps as they arrive and reduce each pair to DiffStats at once.

The inference stack runs a batch first and parks its taps here; the training stack then runs each prompt
and every tap it emits is diffed against the parked partner and both are dropped. Memory is bounded by one
inference batch (`--batch-tokens`), never by the number of prompts.
"""

from __future__ import annotations

from collections import Counter

import torch

from .errors import StackError
from .metrics import DiffStats
from .taps import TapKey


class TapPairing:
    def __init__(self, expected: list[TapKey]) -> None:
        self.expected = expected
        self.stats: dict[TapKey, DiffStats] = {key: DiffStats() for key in expected}
        self._parked: dict[tuple[int, TapKey], torch.Tensor] = {}
        self._paired: Counter = Counter()  # prompt_id -> number of taps paired

    def park(self, prompt_id: int, key: TapKey, tensor: torch.Tensor) -> None:
        """An inference-side tap, kept until its training-side partner arrives."""
        if (prompt_id, key) in self._parked:
            raise StackError(f"the inference stack produced tap {key.label} twice for prompt {prompt_id}")
        self._parked[(prompt_id, key)] = tensor

    def pair(self, prompt_id: int, key: TapKey, tensor: torch.Tensor) -> None:
        """A training-side tap: diff it against its parked partner and drop both."""
        partner = self._parked.pop((prompt_id, key), None)
        if partner is None:
            raise StackError(f"tap {key.label} of prompt {prompt_id} exists on the training side only")
        if partner.shape != tensor.shape:
            raise StackError(
                f"tap {key.label} has shape {tuple(partner.shape)} (inference) vs {tuple(tensor.shape)} (training)"
            )
        self.stats[key] = self.stats[key].merge(DiffStats.of(partner, tensor.to(partner.device)))
        self._paired[prompt_id] += 1

    def finish_prompt(self, prompt_id: int) -> None:
        """Every expected tap must have been paired exactly once for this prompt; leftovers are a seam bug."""
        leftovers = sorted(key.label for pid, key in self._parked if pid == prompt_id)
        if leftovers or self._paired[prompt_id] != len(self.expected):
            raise StackError(
                f"prompt {prompt_id}: {self._paired[prompt_id]} of {len(self.expected)} taps paired; "
                f"inference-only taps: {', '.join(leftovers[:5]) or 'none'}"
            )
        del self._paired[prompt_id]
