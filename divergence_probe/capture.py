"""Pair the two stacks' taps as they arrive; reduce a prompt's pairs into running totals when the prompt is done.

The inference stack runs a batch first and parks its taps here; the training stack then runs each prompt, and
every tap it emits is filed beside its parked partner. When the prompt is finished, its pairs are reduced and
dropped. Memory is bounded by one inference batch (`--batch-tokens`) plus one prompt, never by the number of
prompts.

Taps are kept as the stacks hand them over (a stack never writes to a tap it emitted: stacks/base.TapSink), and
are reduced in as few calls as possible: all pairs of one prompt with the same shape (every layer's hidden-size
taps, say) are stacked into one `[taps, tokens, features]` pair, and all of a prompt's stacks are reduced by one
call of the fused reduction (fused.py): per call, the fixed cost exceeds the arithmetic of a small tap.

The per-tap sums are merged into running totals on the taps' device (float64: the same additions, in the same
prompt order, as merging DiffStats on the host) and read back once, when `stats` is read. So the host never
waits for a reduction, and its per-tap work while a run goes on is a few dictionary operations.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .errors import StackError
from .fused import fused_diff_sums
from .metrics import DIFF_SUM_IS_MAX, DiffStats
from .taps import TapKey


class TapPairing:
    def __init__(self, expected: list[TapKey]) -> None:
        self.expected = expected
        self._index = {key: i for i, key in enumerate(expected)}
        self._counts = [0] * len(expected)  # elements reduced per tap (host ints: exact, free)
        self._totals: torch.Tensor | None = None  # [taps, 7] float64 running diff_sums, on the taps' device
        self._is_max: torch.Tensor | None = None  # which of those 7 columns merge by max (the others add)
        self._row_indices: dict[tuple[int, ...], torch.Tensor] = {}  # a group's rows in _totals, on that device
        self._parked: dict[tuple[int, TapKey], torch.Tensor] = {}
        self._pairs: dict[int, list[tuple[TapKey, torch.Tensor, torch.Tensor]]] = defaultdict(list)

    @property
    def stats(self) -> dict[TapKey, DiffStats]:
        """Per-tap statistics of every finished prompt (reads the totals back: waits for the device)."""
        totals = self._totals.tolist() if self._totals is not None else [[0.0] * 7] * len(self.expected)
        return {key: DiffStats.from_sums(n, sums) for key, n, sums in zip(self.expected, self._counts, totals)}

    def park(self, prompt_id: int, key: TapKey, tensor: torch.Tensor) -> None:
        """An inference-side tap, kept until its training-side partner arrives."""
        if key not in self._index:
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
        if tensor.get_device() != partner.get_device():  # (an int: cheaper than comparing torch.device objects)
            tensor = tensor.to(partner.device)
        self._pairs[prompt_id].append((key, partner, tensor))

    def finish_prompt(self, prompt_id: int) -> None:
        """Reduce the prompt's pairs. Every expected tap must have been paired exactly once; leftovers are a seam bug.

        (park refuses unexpected and repeated taps, so with every expected tap paired none can be left over.)"""
        pairs = self._pairs.pop(prompt_id, [])
        if len(pairs) != len(self.expected):
            leftovers = sorted(key.label for pid, key in self._parked if pid == prompt_id)
            raise StackError(
                f"prompt {prompt_id}: {len(pairs)} of {len(self.expected)} taps paired; "
                f"inference-only taps: {', '.join(leftovers[:5]) or 'none'}"
            )
        groups: dict[tuple, list] = defaultdict(list)  # same shape and dtype: one stack
        for pair in pairs:
            groups[(pair[1].shape, pair[1].dtype)].append(pair)
        rows, tests, refs = [], [], []
        for group in groups.values():
            keys, test, ref = zip(*group)
            n = test[0].numel()
            for key in keys:
                row = self._index[key]
                rows.append(row)
                self._counts[row] += n
            tests.append(torch.stack(test) if len(test) > 1 else test[0][None])
            refs.append(torch.stack(ref) if len(ref) > 1 else ref[0][None])
        if tests:  # (none with --taps none)
            self._add(tuple(rows), fused_diff_sums(tests, refs))

    def _add(self, rows: tuple[int, ...], sums: torch.Tensor) -> None:
        """Merge a prompt's [taps, 7] sums into the totals: sums add, maxima take the max (as DiffStats.merge)."""
        if self._totals is None:
            self._totals = sums.new_zeros(len(self.expected), sums.shape[1])
            self._is_max = torch.tensor(DIFF_SUM_IS_MAX, device=sums.device)
        index = self._row_indices.get(rows)
        if index is None:
            index = self._row_indices[rows] = torch.tensor(rows, device=sums.device)
        current = self._totals.index_select(0, index)
        self._totals.index_copy_(0, index, torch.where(self._is_max, torch.maximum(current, sums), current + sums))
