"""The Region type: an aligned reference implementation plus one reversible patcher per stack.

"Aligned" (../shared/NUMERICS.md) means: keep the region's intermediates in FP32 and round once, to
nearest even, at the region's output. The same aligned function runs on both stacks, so a region patched
on both sides maps bitwise-equal inputs to bitwise-equal outputs, whatever each stack shipped.

A patcher takes a stack's loaded model and a HookSet, replaces what it must through `hooks.replace`
(undone when the HookSet exits) and returns how many modules it patched; zero means the seam moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..stacks.hooks import HookSet

Patcher = Callable[[torch.nn.Module, HookSet], int]


@dataclass(frozen=True)
class Region:
    name: str
    summary: str  # one line for --help and the README: what changes and where it rounds
    patchers: dict[str, Patcher] = field(default_factory=dict)  # stack name -> patcher
