"""The Region type: an aligned reference implementation plus one planning patcher per stack.

"Aligned" (docs/numerics.md) means: keep the region's intermediates in FP32 and round once, to
nearest even, at the region's output. The same aligned function runs on both stacks, so a region patched
on both sides maps bitwise-equal inputs to bitwise-equal outputs, whatever each stack shipped.

A patcher only *finds*: it takes a stack's loaded model and returns the replacements it needs (one per
matched target, changing nothing), or raises SeamMissing when a target it needs is not where this stack
version keeps it. `regions.patch` applies the plans of every requested region only once all were found,
through a HookSet, so a half-patched model cannot exist and every change is undone on exit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing the module (the CLI's --help) needs no torch
    import torch

from ..models import StackLayout, family_of
from ..engines.hooks import Replacement

Patcher = Callable[["torch.nn.Module"], list[Replacement]]


class SeamMissing(Exception):
    """Raised by a patcher: `what` it needs is absent from the model (regions.patch names stack, version and
    region around it)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def child(obj, name: str, where: str):
    """obj.name, or SeamMissing naming `where` it was looked for."""
    value = getattr(obj, name, None)
    if value is None:
        raise SeamMissing(f"{name} in {where}")
    return value


@dataclass(frozen=True)
class Region:
    name: str
    summary: str  # one line for --help and the README: what changes and where it rounds
    patchers: dict[str, Patcher] = field(default_factory=dict)  # stack name -> patcher
    # not a patch: the trainer takes this from the engine's run of the same sequences, which the run loop wires
    # (routing replay); `aligned`/`plan` leave it to the run loop
    from_engine: bool = False
    # whether a model family's layers have this region (None: every family's do); models/ describes the family
    exists_in: Callable[[object], bool] | None = None
    # vLLM runs the patched code outside its compiled graph (the logits: `compute_logits` is eager), so a compiled
    # engine calls the patch at every step and its build has no trace of it to prove
    outside_graph: bool = False
    # regions whose patch of a target this region's patch of that target includes (residual's norms are rmsnorm's
    # aligned norm fed from the FP32 stream): aligned together, this region's replacement of a shared target is the
    # one applied, and the other's other targets are patched as usual
    supersedes: tuple[str, ...] = ()


def layout(model, stack: str) -> StackLayout:
    """Where the loaded model's family keeps its modules on `stack` ("hf" or "vllm"): models/."""
    return getattr(family_of(model), stack)


def model_part(model, stack: str, role: str):
    """The model-level module of `role` (models/: layers, final_norm, lm_head) of a loaded model of `stack`, or
    SeamMissing naming the first part of its path that is absent and where."""
    obj, where = model, "the model"
    for name in layout(model, stack).model[role].split("."):
        obj = child(obj, name, where)
        where = f"model.{name}" if where == "the model" else f"{where}.{name}"
    return obj


def decoder_layers(model, stack: str) -> list:
    """The decoder layers of a loaded model of `stack`, where its family keeps them (Qwen2/Qwen3: model.layers)."""
    return list(model_part(model, stack, "layers"))


def part(layer, where: str, stack_layout: StackLayout, role: str):
    """The module of a decoder layer with this role in the family's layout ("": the layer), or SeamMissing naming
    the first part of its path that is absent and where (`where`: the layer, e.g. model.model.layers[2])."""
    path = stack_layout.layer[role] if role else ""
    obj = layer
    for name in path.split(".") if path else ():
        obj = child(obj, name, where)
        where = f"{where}.{name}"
    return obj


def layer_name(stack_layout: StackLayout, i: int) -> str:
    """How messages name decoder layer i: as a path from the loaded model (`model.model.layers[2]`)."""
    return f"model.{stack_layout.model['layers']}[{i}]"
