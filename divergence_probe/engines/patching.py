"""Region patches on loaded engines: each engine's patches by region, and the step that applies them once every target
was found.

A patch only *finds*: it takes an engine's loaded model and returns the replacements a region needs there (one per
matched target, changing nothing), or raises SeamMissing when a target it needs is not where this engine version keeps
it. `patch` and `aligned` apply the plans of every requested region only once all were found, through a HookSet, so a
half-patched model cannot exist and every change is undone on exit. The math a patch runs is the region's
(regions/); where it goes is the engine's (engines/<engine>/patches/, one module per region).

A new region is its regions/ module plus one patch module and one PATCHES line per engine; a new engine names its
patches in its stack class (`StackClass.patches`).
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from dataclasses import replace
from importlib import import_module
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

from ..errors import StackError
from ..regions import get_region, patched
from .hooks import HookSet, Replacement
from .layouts import SeamMissing, decoder_layers, layer_name, layout_of, model_part, part

if TYPE_CHECKING:  # annotations only: importing the module (the CLI's --help) needs no torch
    import torch

log = logging.getLogger(__name__)

Patcher = Callable[["torch.nn.Module"], list[Replacement]]

def patches_of(engine: str) -> Mapping[str, Patcher]:
    """The region patches the stack class registered as `engine` names (none for one that patches nothing),
    imported now."""
    from . import stack_class

    target = stack_class(engine).patches
    if not target:
        return {}
    module, attr = target.split(":")
    return getattr(import_module(module), attr)


STREAM_NORMS = ("input_norm", "post_norm")  # the norms that read the residual stream in each layer


def stream_norms(model, engine: str) -> list:
    """Every norm that reads the residual stream: each layer's input and post-attention norm, and the final norm."""
    stack_layout = layout_of(model, engine)
    found = [part(layer, layer_name(stack_layout, i), stack_layout, role)
             for i, layer in enumerate(decoder_layers(model, engine)) for role in STREAM_NORMS]
    return found + [model_part(model, engine, "final_norm")]


def library(model) -> str:
    """'transformers 5.19.0': the library whose modeling code built `model` (whose seams the patches find)."""
    top = type(model).__module__.split(".")[0]
    return f"{top} {getattr(sys.modules.get(top), '__version__', 'of unknown version')}"


def plan(engine: str, model, regions: Sequence[str]) -> dict[str, list[Replacement]]:
    """Find every target of every region on one model, changing nothing: region -> its replacements. Regions taken
    from the engine (`from_engine`) are the run loop's and are left out."""
    plans = {}
    patches = patches_of(engine)
    for name in patched(regions):
        if name not in patches:
            raise StackError(f"region {name} has no patch for the {engine} stack; leave {name} out of the "
                             "aligned regions")
        where = f"region {name} cannot be aligned on the {engine} stack ({library(model)})"
        fix = f"this version's modeling code moved the seam: leave {name} out of the aligned regions or use a " \
              "supported transformers/vLLM version (docs/reference/install.md, 'Supported versions')"
        try:
            found = patches[name](model)
        except SeamMissing as e:
            raise StackError(f"{where}: no {e.what}; {fix}") from None
        if not found:
            raise StackError(f"{where}: it found nothing to patch; {fix}")
        plans[name] = [replace(r, owner=f"region {name} on {engine}") for r in found]
    for name in plans:  # a target two regions replace goes to the one whose replacement includes the other's
        for other in set(get_region(name).supersedes) & set(plans):
            taken = {r.key for r in plans[name]}
            plans[other] = [r for r in plans[other] if r.key not in taken]
    return plans


def patch(engine: str, model, regions: Sequence[str], hooks: HookSet) -> dict[str, int]:
    """Patch `regions` into one loaded model once all their targets were found; returns region -> how many
    targets it replaced. A missing target or an overlap raises before anything changed."""
    plans = plan(engine, model, regions)
    hooks.apply([r for found in plans.values() for r in found])
    for name, found in plans.items():
        log.debug("aligned %s on %s: %d targets", name, engine, len(found))
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
