"""Adopt the fix in an RL trainer: align regions of a transformers model in place.

    from transformers import AutoModelForCausalLM
    from divergence_probe import align

    model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-1.5B", dtype="bfloat16")
    handle = align.apply(model, regions=("rope",))   # RoPE now computed in FP32, rounded once
    ...                                              # train as usual; weights are untouched
    handle.remove()                                  # back to transformers' shipped numerics

`apply` returns a handle that is also a context manager (`with align.apply(model): ...`). Align the same
regions on the inference engine too (see `divergence_probe.engines.patching.aligned`) for the two to agree.
"""

from __future__ import annotations

from typing import Sequence

from .engines.hooks import HookSet
from .engines.patching import patch
from .regions import ALL_REGIONS, parse_regions


def apply(model, regions: Sequence[str] | str = ALL_REGIONS) -> HookSet:
    """Align `regions` on a transformers model until the returned handle is removed. Every target is found
    before anything changes: a missing one raises StackError, overlapping patches PatchConflict."""
    hooks = HookSet()
    try:
        patch("hf", model, parse_regions(regions), hooks)
    except BaseException:
        hooks.remove()
        raise
    return hooks
