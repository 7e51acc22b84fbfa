"""Pair the two stacks' taps as they arrive; reduce a prompt's pairs into running totals when the prompt is done.

The inference stack runs a batch first and parks its taps here; the training stack then runs each prompt, and
every tap it emits is filed under that prompt. When the prompt is finished, its taps meet their parked partners,
and the pairs are reduced and dropped. Memory is bounded by one inference batch (`--batch-tokens`) plus one prompt,
never by the number of prompts.

Taps are kept as the stacks hand them over (a stack never writes to a tap it emitted: stacks/base.TapSink), and
are reduced in as few calls as possible: all pairs of one prompt with the same shape (every layer's hidden-size
taps, say) are stacked into one `[taps, tokens, features]` pair, and all of a prompt's stacks are reduced by one
call of the fused reduction (fused.py): per call, the fixed cost exceeds the arithmetic of a small tap.

The per-tap sums are merged into running totals on the taps' device (float64: the same additions, in the same
prompt order, as merging DiffStats on the host) and read back once, when `stats` is read. So the host never
waits for a reduction, and its per-tap work while a run goes on is a list append and a dictionary lookup.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

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
        self._row_indices: dict[tuple[int, ...], torch.Tensor] = {}  # a plan's rows in _totals, on that device
        self._parked: dict[tuple[int, TapKey], torch.Tensor] = {}
        self._filed: dict[int, list[tuple[TapKey, torch.Tensor]]] = defaultdict(list)
        self._plans: dict[tuple[TapKey, ...], _Plan] = {}  # by the order a prompt's training taps arrived in

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
        """A training-side tap, filed under its prompt. It meets its parked partner, and both are checked, when the
        prompt is finished: this runs on the host between two kernels of the training forward, for every tap."""
        self._filed[prompt_id].append((key, tensor))

    def finish_prompt(self, prompt_id: int) -> None:
        """Pair the prompt's taps and reduce the pairs. Every expected tap must have been paired exactly once;
        leftovers are a seam bug.

        The taps arrive in the same order for every prompt of a run, so how they pair and group is planned once per
        order (and checked then: each expected tap once); each prompt then checks shapes, dtypes and devices once per
        group, and names the tap only when a group does not match."""
        filed = self._filed.pop(prompt_id, [])
        keys = tuple(key for key, _ in filed)
        try:
            infer = [self._parked.pop((prompt_id, key)) for key in keys]
        except KeyError as missing:
            raise StackError(f"tap {missing.args[0][1].label} of prompt {prompt_id} exists on the training side "
                             "only (or twice)") from None
        plan = self._plans.get(keys)
        if plan is None:
            plan = self._plans[keys] = self._plan(prompt_id, keys, infer)
        train = [t for _, t in filed]
        stacks = _stack(plan, keys, infer, train)
        if stacks is None:  # this prompt's taps group otherwise than the plan's (shapes that vary between prompts)
            plan = self._plan(prompt_id, keys, infer)
            stacks = _stack(plan, keys, infer, train)
        tests, refs = stacks
        for rows, test in zip(plan.group_rows, tests):
            elements = test[0].numel()
            for row in rows:
                self._counts[row] += elements
        if tests:  # (none with --taps none)
            self._add(plan.rows, fused_diff_sums(tests, refs))

    def _plan(self, prompt_id: int, keys: tuple[TapKey, ...], infer: list[torch.Tensor]) -> "_Plan":
        if len(keys) != len(self.expected) or len(set(keys)) != len(keys):
            leftovers = sorted(key.label for pid, key in self._parked if pid == prompt_id)
            repeated = sorted({key.label for key in keys if keys.count(key) > 1})
            raise StackError(
                f"prompt {prompt_id}: {len(set(keys))} of {len(self.expected)} taps paired; "
                f"inference-only taps: {', '.join(leftovers[:5]) or 'none'}"
                + (f"; taps twice on the training side: {', '.join(repeated[:5])}" if repeated else "")
            )
        groups: dict[tuple, list[int]] = defaultdict(list)  # same shape and dtype: one stack
        for i, tensor in enumerate(infer):
            groups[(tensor.shape, tensor.dtype)].append(i)
        members = tuple(tuple(m) for m in groups.values())
        group_rows = tuple(tuple(self._index[keys[i]] for i in m) for m in members)
        return _Plan(members, group_rows, tuple(row for rows in group_rows for row in rows))

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


@dataclass(frozen=True)
class _Plan:
    """How one order of a prompt's taps pairs into stacks: `groups` are the positions (in arrival order) of the taps
    reduced together, `group_rows` their rows in the totals, `rows` all of those in the reduction's output order."""

    groups: tuple[tuple[int, ...], ...]
    group_rows: tuple[tuple[int, ...], ...]
    rows: tuple[int, ...]


def _stack(plan: _Plan, keys, infer, train) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Per group of the plan: the inference taps stacked (the reduction's test) and the training taps (its reference).
    None when the inference taps of a group do not stack (the plan does not fit this prompt); raises naming the tap
    when a training tap does not match its partner."""
    tests, refs = [], []
    for members in plan.groups:
        try:
            test = torch.stack([infer[i] for i in members]) if len(members) > 1 else infer[members[0]][None]
        except RuntimeError:
            return None
        try:
            ref = torch.stack([train[i] for i in members]) if len(members) > 1 else train[members[0]][None]
        except RuntimeError:  # shapes or devices differ within the group (stack promotes dtypes)
            ref = None
        if ref is None or ref.shape != test.shape or ref.dtype != test.dtype:
            _check_pairs(keys, infer, train, members)
        tests.append(test)
        refs.append(ref if ref.device == test.device else ref.to(test.device))
    return tests, refs


def _check_pairs(keys, infer, train, members) -> None:
    """Raise naming the first tap of a group whose two sides differ in shape or dtype, or its devices."""
    for i in members:
        if infer[i].shape != train[i].shape or infer[i].dtype != train[i].dtype:
            raise StackError(f"tap {keys[i].label} is {tuple(infer[i].shape)} {infer[i].dtype} (inference) vs "
                             f"{tuple(train[i].shape)} {train[i].dtype} (training)")
    devices = sorted({str(train[i].device) for i in members})
    raise StackError(f"the training stack's taps {keys[members[0]].label} .. {keys[members[-1]].label} are on "
                     f"several devices ({', '.join(devices)}); report this as a bug")
