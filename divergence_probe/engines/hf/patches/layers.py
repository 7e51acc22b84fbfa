"""Chosen decoder layers in FP32 on transformers (the fp32_layers remedy): the aligned RMSNorm, RoPE and SwiGLU of
those layers only, every other layer and the final norm as shipped.

The region patches (rmsnorm.py, swiglu.py, rope.py) find their targets in every layer; this keeps the targets inside
the chosen layers. RoPE is the one region whose patch is not per layer: the model's one rotary module hands every
layer its cos/sin, and the modeling file's apply_rotary_pos_emb rotates in FP32 when handed the aligned half-width
FP32 cos/sin (rope.py's marker). So the rotary module is left as shipped, and each chosen layer's attention is handed
the aligned cos/sin of its own positions instead; the other layers get the shipped ones and rotate as shipped.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ....errors import StackError
from ....regions.rope import cos_sin
from ...hooks import Replacement
from ...layouts import decoder_layers, layer_name, layout_of, part
from . import rope

REGIONS = ("rope", "swiglu", "rmsnorm")  # what "a layer in FP32" aligns: its norms, its RoPE and its SwiGLU


def patch(model: torch.nn.Module, layers: Sequence[int], regions: Sequence[str] = REGIONS) -> list[Replacement]:
    """The replacements that run `regions` aligned in the decoder layers `layers` (indices) and nowhere else."""
    from ...patching import plan

    stack_layers = decoder_layers(model, "hf")
    outside = sorted(set(layers) - set(range(len(stack_layers))))
    if outside:
        raise StackError(f"layer {outside[0]} is not a decoder layer of this model (it has {len(stack_layers)})")
    inside = {id(m) for i in layers for m in stack_layers[i].modules()}
    found = []
    for name, replacements in plan("hf", model, regions).items():
        # the modeling file's apply_rotary_pos_emb (shared): it rotates in FP32 only when handed the aligned cos/sin
        found += [r for r in replacements if id(r.target) in inside or (name == "rope" and r.shared)]
    if "rope" in regions:
        hf = layout_of(model, "hf")
        freqs = rope.frequencies(model)
        for i in layers:
            attention = part(stack_layers[i], layer_name(hf, i), hf, hf.regions["rope"])
            found.append(Replacement(attention, "forward", _aligned_angles(attention.forward, freqs, i),
                                     owner="fp32 layers"))
    return found


def _aligned_angles(shipped, freqs: torch.Tensor, layer: int):
    """The attention's forward, handed the aligned FP32 cos/sin of its own positions instead of the shipped ones."""

    def forward(*args, position_embeddings=None, position_ids=None, **kwargs):
        if position_ids is None:
            raise StackError(f"the FP32 RoPE of layer {layer} needs the positions, which its decoder layer did not hand "
                             "its attention")
        return shipped(*args, position_embeddings=cos_sin(position_ids, freqs), position_ids=position_ids, **kwargs)

    return forward
