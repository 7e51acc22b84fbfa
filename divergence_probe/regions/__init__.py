"""Region registry: the aligned reference math and what each region aligns, whichever engine it is patched into.

A new region (say `lm_head` in FP32) is one module defining a `Region` plus one line in REGIONS, and one patch per
engine (engines/patching.py: where it goes on each engine, and the step that applies it).
"""

from __future__ import annotations

from importlib import import_module
from typing import Sequence

from ..errors import ProbeError
from .base import Region

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


__all__ = ["ALL_REGIONS", "REGIONS", "Region", "check_regions_exist", "from_engine", "get_region", "parse_regions",
           "patched"]
