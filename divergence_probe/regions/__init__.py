"""Region registry, and the patch step that aligns regions on loaded stacks once every target was found.

A new region (say `lm_head` in FP32) is one module defining a `Region` plus one line in REGIONS.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from dataclasses import replace
from importlib import import_module
from typing import Iterator, Sequence

from ..errors import ProbeError, StackError
from ..engines.hooks import HookSet, Replacement
from .base import Region, SeamMissing

log = logging.getLogger(__name__)

REGIONS: dict[str, str] = {
    "rope": "divergence_probe.regions.rope:ROPE",
    "swiglu": "divergence_probe.regions.swiglu:SWIGLU",
    "rmsnorm": "divergence_probe.regions.rmsnorm:RMSNORM",
    "routing": "divergence_probe.regions.routing:ROUTING",
    "lm_head": "divergence_probe.regions.lm_head:LM_HEAD",
    "residual": "divergence_probe.regions.residual:RESIDUAL",
}
# the default wherever "every region" is meant: the numeric ones every family has (routing needs a MoE model)
ALL_REGIONS: tuple[str, ...] = ("rope", "swiglu", "rmsnorm")


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


def library(model) -> str:
    """'transformers 5.19.0': the library whose modeling code built `model` (whose seams the patchers find)."""
    top = type(model).__module__.split(".")[0]
    return f"{top} {getattr(sys.modules.get(top), '__version__', 'of unknown version')}"


def patched(regions: Sequence[str]) -> tuple[str, ...]:
    """The regions that patch a stack's numerics: all but those the run loop takes from the engine (routing)."""
    return tuple(name for name in regions if not get_region(name).from_engine)


def from_engine(regions: Sequence[str]) -> tuple[str, ...]:
    """The regions the trainer takes from the engine's run (routing replay): wired by the run loop, not patched."""
    return tuple(name for name in regions if get_region(name).from_engine)


def check_regions_exist(family, regions: Sequence[str]) -> None:
    """A region the family's layers do not have (swiglu in a mixture of experts; routing in a dense model) is one
    line naming the regions it has."""
    has = [r for r in REGIONS if get_region(r).exists_in is None or get_region(r).exists_in(family)]
    for name in regions:
        if name not in has:
            raise ProbeError(f"region {name} does not exist in {family.model_type} models; leave it out (regions of "
                             f"this model: {','.join(has)})")


def plan(stack_name: str, model, regions: Sequence[str]) -> dict[str, list[Replacement]]:
    """Find every target of every region on one model, changing nothing: region -> its replacements. Regions taken
    from the engine (`from_engine`) are the run loop's and are left out."""
    plans = {}
    for name in patched(regions):
        region = get_region(name)
        if stack_name not in region.patchers:
            raise StackError(f"region {name} has no patch for the {stack_name} stack; leave {name} out of the "
                             "aligned regions")
        where = f"region {name} cannot be aligned on the {stack_name} stack ({library(model)})"
        fix = f"this version's modeling code moved the seam: leave {name} out of the aligned regions or use a " \
              "supported transformers/vLLM version (docs/reference.md, 'Supported versions')"
        try:
            found = region.patchers[stack_name](model)
        except SeamMissing as e:
            raise StackError(f"{where}: no {e.what}; {fix}") from None
        if not found:
            raise StackError(f"{where}: it found nothing to patch; {fix}")
        plans[name] = [replace(r, owner=f"region {name} on {stack_name}") for r in found]
    for name in plans:  # a target two regions replace goes to the one whose replacement includes the other's
        for other in set(get_region(name).supersedes) & set(plans):
            taken = {r.key for r in plans[name]}
            plans[other] = [r for r in plans[other] if r.key not in taken]
    return plans


def patch(stack_name: str, model, regions: Sequence[str], hooks: HookSet) -> dict[str, int]:
    """Patch `regions` into one loaded model once all their targets were found; returns region -> how many
    targets it replaced. A missing target or an overlap raises before anything changed."""
    plans = plan(stack_name, model, regions)
    hooks.apply([r for found in plans.values() for r in found])
    for name, found in plans.items():
        log.debug("aligned %s on %s: %d targets", name, stack_name, len(found))
    return {name: len(found) for name, found in plans.items()}


@contextmanager
def aligned(stacks: Sequence, regions: Sequence[str]) -> Iterator[None]:
    """Align `regions` on every given loaded stack for the duration of the block; undone on exit. Every
    target on every stack is found before any is changed."""
    regions = patched(regions)
    with HookSet() as hooks:
        for stack in stacks:
            if regions:  # a compiled engine takes a patch when it is built, not once loaded
                stack.capabilities().check_patchable()
        plans = [plan(stack.name, stack.model, regions) for stack in stacks]
        hooks.apply([r for p in plans for found in p.values() for r in found])
        yield


__all__ = ["ALL_REGIONS", "REGIONS", "Region", "aligned", "check_regions_exist", "from_engine", "get_region", "library", "parse_regions", "patch",
           "patched", "plan"]
