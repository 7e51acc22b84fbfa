"""Pair the two stacks' taps as they arrive; reduce a prompt's pairs into running totals when the prompt is done.

The inference stack runs a batch first and parks its taps here; the training stack then runs each prompt, and
every tap it emits is filed under that prompt. When the prompt is finished, its taps meet their parked partners,
and the pairs are reduced and dropped. Memory is bounded by one inference batch (`--batch-tokens`) plus one prompt,
never by the number of prompts.

Taps are kept as the stacks hand them over (valid until the stack's next call, engines/base.TapSink: every prompt
of an inference batch is finished before the run loop calls the inference stack again), and
are reduced in as few calls as possible: all pairs of one prompt with the same shape (every layer's hidden-size
taps, say) are stacked into one `[taps, tokens, features]` pair, and all of a prompt's stacks are reduced by one
call of the fused reduction (numerics/fused.py): per call, the fixed cost exceeds the arithmetic of a small tap. A stack that
hands several taps over already stacked (a compiled engine: one tensor per width) is reduced as it is, against the
training taps stacked in its order.

The per-tap sums are merged into running totals on the taps' device (float64: the same additions, in the same
prompt order, as merging DiffStats on the host) and read back once, when `stats` is read. So the host never
waits for a reduction, and its per-tap work while a run goes on is a list append and a dictionary lookup.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .. import timings
from ..errors import StackError
from ..numerics.fused import fused_diff_sums
from ..numerics.metrics import DIFF_SUM_IS_MAX, DiffStats
from ..taps import Tap, TapKey


class TapPairing:
    def __init__(self, expected: list[TapKey]) -> None:
        self.expected = expected
        self._index = {key: i for i, key in enumerate(expected)}
        self._counts = [0] * len(expected)  # elements reduced per tap (host ints: exact, free)
        self._totals: torch.Tensor | None = None  # [taps, 7] float64 running diff_sums, on the taps' device
        self._is_max: torch.Tensor | None = None  # which of those 7 columns merge by max (the others add)
        self._row_indices: dict[tuple[int, ...], torch.Tensor] = {}  # a plan's rows in _totals, on that device
        self._parked: dict[int, dict[Tap, torch.Tensor]] = defaultdict(dict)  # by prompt, in arrival order
        self._filed: dict[int, list[tuple[TapKey, torch.Tensor]]] = defaultdict(list)
        self._plans: dict[tuple, _Plan] = {}  # by the order a prompt's taps arrived in, on each side
        # Most elements (per side) one reduction call stacks and reduces (runs/memory.py sets it when a prompt's pairs
        # in one call would not fit); None: all of a prompt's pairs in one call. Each pair is reduced on its own
        # either way, so the statistics are the same to the bit (tests/models/test_memory_plan.py).
        self.chunk_elements: int | None = None

    @property
    def stats(self) -> dict[TapKey, DiffStats]:
        """Per-tap statistics of every finished prompt (reads the totals back: waits for the device)."""
        totals = self._totals.tolist() if self._totals is not None else [[0.0] * 7] * len(self.expected)
        return {key: DiffStats.from_sums(n, sums) for key, n, sums in zip(self.expected, self._counts, totals)}

    def park(self, prompt_id: int, tap: Tap, tensor: torch.Tensor) -> None:
        """An inference-side hand-over (one tap, or several stacked: engines/base.TapSink), kept until the training-side
        partners arrive."""
        parked = self._parked[prompt_id]
        for key in (tap,) if isinstance(tap, TapKey) else tap:
            if key not in self._index:
                raise StackError(f"the inference stack produced tap {key.label}, which this model should not have")
        if tap in parked:
            raise StackError(f"the inference stack produced tap {_label(tap)} twice for prompt {prompt_id}")
        parked[tap] = tensor

    def park_route(self, prompt_id: int, tap: TapKey, tensor: torch.Tensor) -> None:
        """The engine's routes (taps.ROUTE_RECORDS) are no tap to diff: a plain pairing leaves them; a grafting
        capture replays the experts on them (runs/graft.py)."""

    def add_sequences(self, sequences) -> None:
        """The sequences of an inference batch (compare.ScoredSequence): a plain pairing needs only their taps; a
        grafting capture scores its depth curve against their logits (runs/graft.py)."""

    def pair(self, prompt_id: int, key: TapKey, tensor: torch.Tensor) -> None:
        """A training-side tap, filed under its prompt. It meets its parked partner, and both are checked, when the
        prompt is finished: this runs on the host between two kernels of the training forward, for every tap."""
        self._filed[prompt_id].append((key, tensor))

    def finish_prompt(self, prompt_id: int) -> None:
        """Pair the prompt's taps and reduce the pairs. Every expected tap must have been paired exactly once;
        leftovers are a seam bug.

        The taps arrive in the same order for every prompt of a run, so how they pair and group is planned once per
        order (and checked then: each expected tap once on each side); each prompt then checks shapes, dtypes and
        devices once per group, and names the tap only when a group does not match."""
        filed = self._filed.pop(prompt_id, [])
        parked = self._parked.pop(prompt_id, {})
        order = (tuple(key for key, _ in filed), tuple(parked))
        infer, train = list(parked.values()), [t for _, t in filed]
        plan = self._plans.get(order)
        if plan is None:
            plan = self._plans[order] = self._plan(prompt_id, *order, infer)
        reduced = self._reduce(plan, infer, train)
        if reduced is None:  # this prompt's taps group otherwise than the plan's (shapes that vary between prompts)
            plan = self._plan(prompt_id, *order, infer)
            reduced = self._reduce(plan, infer, train)
        sums, counts = reduced
        for row, elements in counts:
            self._counts[row] += elements
        if sums is not None:  # (none with --taps none)
            self._add(plan.rows, sums)

    def _reduce(self, plan: "_Plan", infer, train) -> tuple[torch.Tensor | None, list[tuple[int, int]]] | None:
        """The plan's [taps, 7] sums in its row order and the elements each row reduced; None when the inference
        taps do not stack as the plan says. In one call, or in calls of at most chunk_elements per side."""
        parts = [plan] if self.chunk_elements is None else _parts(plan, infer, self.chunk_elements)
        sums, counts = [], []
        for part in parts:
            stacks = _stack(part, infer, train)
            if stacks is None:
                return None
            tests, refs = stacks
            counts += [(row, test[0].numel()) for group, test in zip(part.groups, tests) for row in group.rows]
            if tests:
                with timings.timed("run.score.train.reduction"):
                    sums.append(fused_diff_sums(tests, refs))
            del stacks, tests, refs  # a chunk's stacked copies go before the next chunk is stacked
        return (torch.cat(sums) if len(sums) > 1 else sums[0] if sums else None), counts

    def _plan(self, prompt_id: int, train_keys: tuple[TapKey, ...], parked: tuple[Tap, ...],
              infer: list[torch.Tensor]) -> "_Plan":
        """Check that each expected tap came once from each side, and group the pairs: a stacked hand-over is a group
        of its own; single taps of the same shape and dtype are stacked into one."""
        where: dict[TapKey, tuple[int, int | None]] = {}  # inference tap -> (hand-over, its row in a stacked one)
        for e, tap in enumerate(parked):
            for j, key in ((None, tap),) if isinstance(tap, TapKey) else enumerate(tap):
                if key in where:
                    raise StackError(f"the inference stack produced tap {key.label} twice for prompt {prompt_id}")
                where[key] = (e, j)
        position = {}  # training tap -> its position in arrival order
        for i, key in enumerate(train_keys):
            if key not in where:
                raise StackError(f"tap {key.label} of prompt {prompt_id} exists on the training side only")
            position.setdefault(key, i)
        if len(train_keys) != len(self.expected) or len(position) != len(train_keys):
            leftovers = sorted(key.label for key in where if key not in position)
            repeated = sorted({key.label for key in train_keys if train_keys.count(key) > 1})
            raise StackError(
                f"prompt {prompt_id}: {len(position)} of {len(self.expected)} taps paired; "
                f"inference-only taps: {', '.join(leftovers[:5]) or 'none'}"
                + (f"; taps twice on the training side: {', '.join(repeated[:5])}" if repeated else "")
            )
        singles: dict[tuple, list[int]] = defaultdict(list)  # same shape and dtype: one stack
        members: list[tuple[tuple[int, ...], tuple[TapKey, ...]]] = []
        for e, tap in enumerate(parked):
            if isinstance(tap, TapKey):
                singles[(infer[e].shape, infer[e].dtype)].append(e)
            else:
                members.append(((e,), tap))
        members += [(tuple(es), tuple(parked[e] for e in es)) for es in singles.values()]
        groups = tuple(_Group(handovers, isinstance(parked[handovers[0]], TapKey), keys,
                              tuple(position[key] for key in keys), tuple(self._index[key] for key in keys))
                       for handovers, keys in members)
        return _Plan(groups, tuple(row for group in groups for row in group.rows))

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
class _Group:
    """Taps reduced together: inference hand-overs `handovers` (positions in arrival order; `singles`: single taps to
    stack, else one stacked hand-over), their `keys` in stack order, those keys' positions among the training taps
    (`train`) and rows in the totals (`rows`)."""

    handovers: tuple[int, ...]
    singles: bool
    keys: tuple[TapKey, ...]
    train: tuple[int, ...]
    rows: tuple[int, ...]
    span: tuple[int, int] | None = None  # a stacked hand-over's taps [start, stop) only (a chunk of it)


@dataclass(frozen=True)
class _Plan:
    """How one arrival order of a prompt's taps pairs into groups; `rows`: every group's rows, in the reduction's
    output order."""

    groups: tuple[_Group, ...]
    rows: tuple[int, ...]


def _stack(plan: _Plan, infer, train) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Per group of the plan: the inference taps stacked (the reduction's test) and the training taps (its reference).
    None when the inference taps of a group do not stack (the plan does not fit this prompt); raises naming the tap
    when a training tap does not match its partner."""
    tests, refs = [], []
    for group in plan.groups:
        if not group.singles:
            test = infer[group.handovers[0]]
            if group.span is not None:
                test = test[group.span[0] : group.span[1]]
        elif len(group.handovers) > 1:
            try:
                test = torch.stack([infer[e] for e in group.handovers])
            except RuntimeError:
                return None
        else:
            test = infer[group.handovers[0]][None]
        try:
            ref = torch.stack([train[i] for i in group.train]) if len(group.train) > 1 else train[group.train[0]][None]
        except RuntimeError:  # shapes or devices differ within the group (stack promotes dtypes)
            ref = None
        if ref is None or ref.shape != test.shape or ref.dtype != test.dtype:
            _check_pairs(group, test, train)
        tests.append(test)
        refs.append(ref if ref.device == test.device else ref.to(test.device))
    return tests, refs


def _parts(plan: _Plan, infer, limit: int) -> list[_Plan]:
    """The plan cut into calls of about `limit` elements per side, in its row order: a group larger than that is
    split into runs of at least two pairs (a run of one would stack nothing, but reduce a lone row, which a parallel
    reduction may sum in another order), and consecutive runs share a call while they fit."""
    runs: list[tuple[_Group, int]] = []
    for group in plan.groups:
        first = infer[group.handovers[0]]
        per_pair = first.numel() if group.singles else first[0].numel()
        n = len(group.keys)
        pieces = 1 if n * per_pair <= limit or n < 4 else max(1, n // max(2, limit // max(1, per_pair)))
        bounds = [n * k // pieces for k in range(pieces + 1)]
        for a, b in zip(bounds, bounds[1:]):
            if group.singles:
                part = _Group(group.handovers[a:b], True, group.keys[a:b], group.train[a:b], group.rows[a:b])
            else:
                part = _Group(group.handovers, False, group.keys[a:b], group.train[a:b], group.rows[a:b],
                              (a, b) if pieces > 1 else group.span)
            runs.append((part, (b - a) * per_pair))
    calls: list[list[_Group]] = []
    size = 0
    for part, elements in runs:
        if not calls or size + elements > limit:
            calls.append([])
            size = 0
        calls[-1].append(part)
        size += elements
    return [_Plan(tuple(groups), tuple(row for g in groups for row in g.rows)) for groups in calls]


def _check_pairs(group: _Group, test: torch.Tensor, train) -> None:
    """Raise naming the first tap of a group whose two sides differ in shape or dtype, or its devices."""
    for key, infer, i in zip(group.keys, test, group.train):
        if infer.shape != train[i].shape or infer.dtype != train[i].dtype:
            raise StackError(f"tap {key.label} is {tuple(infer.shape)} {infer.dtype} (inference) vs "
                             f"{tuple(train[i].shape)} {train[i].dtype} (training)")
    devices = sorted({str(train[i].device) for i in group.train})
    raise StackError(f"the training stack's taps {group.keys[0].label} .. {group.keys[-1].label} are on "
                     f"several devices ({', '.join(devices)}); report this as a bug")


def _label(tap: Tap) -> str:
    return tap.label if isinstance(tap, TapKey) else f"{tap[0].label} .. {tap[-1].label}"
