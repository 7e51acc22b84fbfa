"""Pair the two stacks' taps as they arrive and reduce them to DiffStats, one tap name at a time.

The inference stack runs a batch first and parks its taps here; the training stack then runs each prompt,
and once it has emitted a tap name for every layer, that name is diffed against its parked partner and
both are dropped. Memory is bounded by one inference batch (`--batch-tokens`), never by the number of prompts.

Taps are copied on arrival into one `[layers, tokens, features]` stack per (prompt, tap name) and side: the
copy protects them from buffers a stack reuses in place (vLLM does), and a whole stack is reduced by one
fused kernel (fused.py) instead of one call per layer, whose fixed cost (~0.1 ms on CPU, more than the
arithmetic of a small tap) dominated. The sums are read back to the host once per prompt, so a GPU never
waits on the host between taps.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from .errors import StackError
from .fused import fused_diff_sums
from .metrics import DiffStats
from .taps import TapKey


@dataclass
class _Stack:
    """One side's taps of one name for one prompt: `[len(keys), *shape]`, filled slot by slot."""

    keys: list[TapKey]
    data: torch.Tensor
    filled: set[int] = field(default_factory=set)

    @property
    def full(self) -> bool:
        return len(self.filled) == len(self.keys)


class TapPairing:
    def __init__(self, expected: list[TapKey]) -> None:
        self.expected = expected
        self.stats: dict[TapKey, DiffStats] = {key: DiffStats() for key in expected}
        self._keys_of: dict[str, list[TapKey]] = defaultdict(list)  # tap name -> its keys in layer order
        for key in expected:
            self._keys_of[key.name].append(key)
        self._parked: dict[tuple[int, str], _Stack] = {}
        self._training: dict[tuple[int, str], _Stack] = {}
        self._sums: list[tuple[list[TapKey], int, torch.Tensor]] = []  # reduced, not yet read back
        self._paired: Counter = Counter()  # prompt_id -> number of taps paired

    def park(self, prompt_id: int, key: TapKey, tensor: torch.Tensor) -> None:
        """An inference-side tap, kept until its training-side partner arrives."""
        stack = self._parked.get((prompt_id, key.name))
        if stack is None:
            keys = self._keys_of.get(key.name, [])
            if key not in keys:
                raise StackError(f"the inference stack produced tap {key.label}, which this model should not have")
            data = torch.empty((len(keys), *tensor.shape), dtype=tensor.dtype, device=tensor.device)
            stack = self._parked[(prompt_id, key.name)] = _Stack(keys, data)
        self._put(stack, key, tensor, f"the inference stack produced tap {key.label} twice for prompt {prompt_id}")

    def pair(self, prompt_id: int, key: TapKey, tensor: torch.Tensor) -> None:
        """A training-side tap; once its name is complete, diff it against the parked partner and drop both."""
        partner = self._parked.get((prompt_id, key.name))
        if partner is None or key not in partner.keys or partner.keys.index(key) not in partner.filled:
            raise StackError(f"tap {key.label} of prompt {prompt_id} exists on the training side only")
        if tensor.dtype != partner.data.dtype:  # copy_ would convert silently
            raise StackError(f"tap {key.label} is {partner.data.dtype} (inference) vs {tensor.dtype} (training)")
        stack = self._training.get((prompt_id, key.name))
        if stack is None:
            stack = self._training[(prompt_id, key.name)] = _Stack(partner.keys, torch.empty_like(partner.data))
        self._put(stack, key, tensor, f"the training stack produced tap {key.label} twice for prompt {prompt_id}")
        if stack.full and partner.full:
            del self._parked[(prompt_id, key.name)], self._training[(prompt_id, key.name)]
            self._sums.append((stack.keys, stack.data[0].numel(), fused_diff_sums(partner.data, stack.data)))
            self._paired[prompt_id] += len(stack.keys)

    def finish_prompt(self, prompt_id: int) -> None:
        """Every expected tap must have been paired exactly once for this prompt; leftovers are a seam bug."""
        unpaired = []
        for (pid, name), parked in list(self._parked.items()):
            if pid == prompt_id:
                training = self._training.pop((pid, name), None)
                trained = training.filled if training else set()
                unpaired += [f"{parked.keys[i].label} ({'training' if i in trained else 'inference'} side only)"
                             for i in range(len(parked.keys)) if (i in parked.filled) != (i in trained)]
                del self._parked[(pid, name)]
        paired = self._paired.pop(prompt_id, 0)
        if unpaired or paired != len(self.expected):
            raise StackError(
                f"prompt {prompt_id}: {paired} of {len(self.expected)} taps paired; unpaired: "
                + (", ".join(unpaired[:5]) or "none") + (f" and {len(unpaired) - 5} more" if len(unpaired) > 5 else "")
            )
        if self._sums:
            values = torch.cat([sums for *_, sums in self._sums]).tolist()  # one device -> host transfer
            row = 0
            for keys, n, _ in self._sums:
                for key in keys:
                    self.stats[key] = self.stats[key].merge(DiffStats.from_sums(n, values[row]))
                    row += 1
            self._sums.clear()

    @staticmethod
    def _put(stack: _Stack, key: TapKey, tensor: torch.Tensor, twice: str) -> None:
        slot = stack.keys.index(key)
        if slot in stack.filled:
            raise StackError(twice)
        if tuple(tensor.shape) != tuple(stack.data.shape[1:]):
            raise StackError(f"tap {key.label} has shape {tuple(tensor.shape)}, other layers {tuple(stack.data.shape[1:])}")
        stack.data[slot].copy_(tensor)
        stack.filled.add(slot)
