"""Region registry and the context manager that aligns regions on loaded stacks.

A new region (say `lm_head` in FP32) is one module defining a `Region` plus one line in REGIONS.
"""

from __future__ import annotations

from contextlib import contextmanager
from importlib import import_module
from typing import Iterator, Sequence

from ..errors import ProbeError, StackError
from ..stacks.hooks import HookSet
from .base import Region

REGIONS: dict[str, str] = {
    "rope": "divergence_probe.regions.rope:ROPE",
    "swiglu": "divergence_probe.regions.swiglu:SWIGLU",
    "rmsnorm": "divergence_probe.regions.rmsnorm:RMSNORM",
}


def get_region(name: str) -> Region:
    if name not in REGIONS:
        raise ProbeError(f"unknown region {name!r}; choose from: {', '.join(REGIONS)}")
    module, attr = REGIONS[name].split(":")
    return getattr(import_module(module), attr)


def parse_regions(spec: str | Sequence[str]) -> tuple[str, ...]:
    """'rope,swiglu' or a sequence -> validated names in registry order, without duplicates."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [n for n in names if n]
    for name in names:
        get_region(name)
    return tuple(n for n in REGIONS if n in names)


def patch(stack_name: str, model, regions: Sequence[str], hooks: HookSet) -> None:
    """Patch `regions` into one loaded model; every target is found before anything is changed."""
    patchers = []
    for name in regions:
        region = get_region(name)
        if stack_name not in region.patchers:
            raise StackError(f"region {name} has no patch for the {stack_name} stack")
        patchers.append((name, region.patchers[stack_name]))
    for name, patcher in patchers:
        if patcher(model, hooks) == 0:
            raise StackError(f"region {name} found nothing to patch in the {stack_name} model; the seam moved")


@contextmanager
def aligned(stacks: Sequence, regions: Sequence[str]) -> Iterator[None]:
    """Align `regions` on every given loaded stack for the duration of the block; undone on exit."""
    with HookSet() as hooks:
        for stack in stacks:
            if regions and hasattr(stack, "check_patchable"):  # a compiled engine cannot take a patch after loading
                stack.check_patchable()
            patch(stack.name, stack.model, regions, hooks)
        yield


__all__ = ["REGIONS", "Region", "aligned", "get_region", "parse_regions", "patch"]
