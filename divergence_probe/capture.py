"""Pair the two stacks' taps as they arrive; reduce a prompt's pairs to DiffStats when the prompt is done.

The inference stack runs a batch first and parks its taps here; the training stack then runs each prompt, and
every tap it emits is filed beside its parked partner. When the prompt is finished, its pairs are reduced and
dropped. Memory is bounded by one inference batch (`--batch-tokens`) plus one prompt, never by the number of
prompts.

Taps are kept as the stacks hand them over (a stack never writes to a tap it emitted: stacks/base.TapSink), and
are reduced in as few calls as possible: all pairs of one prompt with the same shape (every layer's hidden-size
taps, say) are stacked into one `[taps, tokens, features]` pair and reduced by one fused kernel (fused.py). Per
call, the fixed cost (~0.1 ms on CPU, more in kernel launches on a GPU) exceeds the arithmetic of a small tap,
and per tap the host's bookkeeping is a few dictionary operations.

A prompt's sums are read back to the host only when the next prompt finishes (or `stats` is read): on a GPU
the reduction then runs while the host queues the next prompt's forward, instead of being waited for. Call
finish_prompt after the prompt's own logprobs have been read back, so that it is not waited for there either.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .errors import StackError
from .fused import fused_diff_sums
from .metrics import DiffStats
from .taps import TapKey


class TapPairing:
    def __init__(self, expected: list[TapKey]) -> None:
        self.expected = expected
        self._stats: dict[TapKey, DiffStats] = {key: DiffStats() for key in expected}
        self._expected = set(expected)
        self._parked: dict[tuple[int, TapKey], torch.Tensor] = {}
        self._pairs: dict[int, list[tuple[TapKey, torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self._pending: list[tuple[tuple[TapKey, ...], int, torch.Tensor]] = []  # reduced, not read back yet

    @property
    def stats(self) -> dict[TapKey, DiffStats]:
        """Per-tap statistics of every finished prompt."""
        self._read_back()
        return self._stats

    def park(self, prompt_id: int, key: TapKey, tensor: torch.Tensor) -> None:
        """An inference-side tap, kept until its training-side partner arrives."""
        if key not in self._expected:
            raise StackError(f"the inference stack produced tap {key.label}, which this model should not have")
        if (prompt_id, key) in self._parked:
            raise StackError(f"the inference stack produced tap {key.label} twice for prompt {prompt_id}")
        self._parked[(prompt_id, key)] = tensor

    def pair(self, prompt_id: int, key: TapKey, tensor: torch.Tensor) -> None:
        """A training-side tap: file it beside its parked partner."""
        partner = self._parked.pop((prompt_id, key), None)
        if partner is None:
            raise StackError(f"tap {key.label} of prompt {prompt_id} exists on the training side only (or twice)")
        if partner.shape != tensor.shape or partner.dtype != tensor.dtype:
            raise StackError(
                f"tap {key.label} is {tuple(partner.shape)} {partner.dtype} (inference) vs "
                f"{tuple(tensor.shape)} {tensor.dtype} (training)"
            )
        if tensor.device != partner.device:
            tensor = tensor.to(partner.device)
        self._pairs[prompt_id].append((key, partner, tensor))

    def finish_prompt(self, prompt_id: int) -> None:
        """Reduce the prompt's pairs. Every expected tap must have been paired exactly once; leftovers are a seam bug."""
        pairs = self._pairs.pop(prompt_id, [])
        leftovers = sorted(key.label for pid, key in self._parked if pid == prompt_id)
        if leftovers or len(pairs) != len(self.expected):
            raise StackError(
                f"prompt {prompt_id}: {len(pairs)} of {len(self.expected)} taps paired; "
                f"inference-only taps: {', '.join(leftovers[:5]) or 'none'}"
            )
        self._read_back()  # the previous prompt's sums: computed by now, so this does not wait
        groups: dict[tuple, list] = defaultdict(list)  # same shape and dtype: one stacked call
        for key, test, ref in pairs:
            groups[(test.shape, test.dtype)].append((key, test, ref))
        for group in groups.values():
            keys, tests, refs = zip(*group)
            test, ref = (torch.stack(x) if len(x) > 1 else x[0][None] for x in (tests, refs))
            self._pending.append((keys, tests[0].numel(), fused_diff_sums(test, ref)))

    def _read_back(self) -> None:
        if not self._pending:
            return
        values = torch.cat([sums for *_, sums in self._pending]).tolist()  # one device -> host transfer
        rows = iter(values)
        for keys, n, _ in self._pending:
            for key in keys:
                self._stats[key] = self._stats[key].merge(DiffStats.from_sums(n, next(rows)))
        self._pending.clear()
