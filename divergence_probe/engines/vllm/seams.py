"""Where each canonical layer tap lives in vLLM's decoder layer: one table for the eager engine's hooks (engines/vllm/stack.py)
and the compiled engine's tap points (compiled_taps.py), so both read the same tensor at the same seam.

The family's vLLM layout (engines/vllm/layouts.py) says which module each tap is read at and what of it; this module
says how each kind of read is done on vLLM's modules. vLLM fuses some modules the canonical taps keep apart (q/k/v are
one GEMM, gate/up another), so their output splits along the features, in the order of the model's
packed_modules_mapping (`StackLayout.fused`); the residual stream leaves a layer only inside the next fused add+norm,
so `resid_out` is formed from the layer's (hidden, residual) output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import StackError
from ...models import Family, dims, family_of, find
from ..layouts import StackLayout, layout_of, lookup
from ..hooks import arg, first_tensor

Read = Callable[[tuple, dict, object], dict[str, torch.Tensor]]  # (args, kwargs, output or None) -> {tap: tensor}


@dataclass(frozen=True)
class Seam:
    names: tuple[str, ...]  # the canonical taps read here
    module: torch.nn.Module
    before: bool  # an input of the module (forward-pre hook), else from its output (forward hook)
    read: Read
    method: str | None = None  # read around this method of `module` instead (an object that is not an nn.Module)


class FusedSplit:
    """How one of vLLM's fused GEMM outputs splits into canonical taps, along the features, in the order of the
    model's packed_modules_mapping."""

    def __init__(self, names: tuple[str, ...], sizes: list[int] | None = None) -> None:
        self.names, self.sizes = names, sizes

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        sizes = self.sizes or [x.shape[-1] // len(self.names)] * len(self.names)
        return dict(zip(self.names, x.split(sizes, dim=-1)))


def _output(name: str, pick=first_tensor) -> Read:
    return lambda a, k, o: {name: pick(o)}


def _input(name: str, index: int, arg_name: str) -> Read:
    return lambda a, k, o: {name: arg(a, k, index, arg_name)}


def _split(split: FusedSplit) -> Read:
    return lambda a, k, o: split(first_tensor(o))


def _routes(a, k, o) -> dict[str, torch.Tensor]:
    """A router's select_experts result (topk_weights, topk_ids): the experts the step's rows were sent to."""
    weights, ids = o
    return {"expert_weights": weights, "expert_ids": ids}


def _layer_output(a, k, o) -> dict[str, torch.Tensor]:
    hidden, residual = o  # the residual is FP32 when the residual region keeps the stream so, and stays FP32 here
    return {"resid_out": (hidden.float() + residual.float()).to(torch.promote_types(hidden.dtype, residual.dtype))}


def _read(seam, family: Family, layout: StackLayout, sizes: dict[str, int]) -> tuple[bool, Read]:
    """(before, read) of one of the family's seams: how each read kind is done on vLLM's modules."""
    [first, *_] = seam.taps
    if seam.read in ("output", "rows"):  # vLLM's activations are [tokens, features] already
        return False, _output(first)
    if seam.read == "residual":  # a fused add+norm returns (normed, residual)
        return False, _output(first, lambda o: o[1])
    if seam.read == "input":
        return True, _input(first, *seam.arg)
    if seam.read == "split":
        [fused] = [f for f in layout.fused if f.module == seam.module]
        return False, _split(FusedSplit(seam.taps, [sizes[d] for d in fused.sizes] if fused.sizes else None))
    if seam.read == "layer_sum":
        return False, _layer_output
    if seam.read == "select_experts":  # the router's own choice, which vLLM's experts then run with
        return False, _routes
    raise ValueError(f"{family.model_type}: vLLM seam read {seam.read!r} is not one engines/vllm/seams.py knows")


def layer_seams(layer, family: Family, sizes: dict[str, int], wanted: frozenset[str] | None = None) -> list[Seam]:
    """Every layer tap's seam in one decoder layer, in the order its forward reaches them. `sizes`: models.dims of
    the model's config, which size the fused splits. `wanted`: only the seams reading one of these names (None: all)."""
    seams = []
    layout = lookup("vllm", family.model_type)
    for seam in layout.seams:
        if wanted is not None and not wanted & set(seam.taps):
            continue
        module = find(layer, layout.layer[seam.module]) if seam.module else layer
        if module is None:
            raise StackError(f"vLLM's {type(layer).__name__} has no {layout.layer[seam.module]}, where the "
                             f"{family.model_type} family reads {', '.join(seam.taps)}; use a supported vLLM version "
                             "(docs/reference/install.md, 'Supported versions')")
        before, read = _read(seam, family, layout, sizes)
        seams.append(Seam(seam.taps, module, before, read, "select_experts" if seam.read == "select_experts" else None))
    return seams


def model_seams(model, wanted: frozenset[str] | None = None) -> list[list[Seam]]:
    """Every decoder layer's seams (`layer_seams`; `wanted`: only those reading these names), by layer index, for a
    loaded vLLM model."""
    family = family_of(model)
    sizes = dims(model.config, _ranks())  # a tensor-parallel rank's fused GEMMs hold its share of each part
    return [layer_seams(layer, family, sizes, wanted) for layer in decoder_layers(model)]


def _ranks() -> int:
    """The tensor-parallel size of the engine this process's model belongs to (1 outside an initialised one)."""
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1


def decoder_layers(model):
    """The vLLM model's decoder layers, where its layout keeps them."""
    return find(model, layout_of(model, "vllm").model["layers"])
