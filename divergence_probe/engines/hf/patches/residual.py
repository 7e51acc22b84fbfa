"""The FP32 residual stream on transformers: each decoder layer's forward adds in FP32 and hands the stream on, and
each norm reading it rounds once (regions/residual.py)."""

from __future__ import annotations

import torch

from ....regions.residual import fp32_add
from ....regions.rmsnorm import normalize
from ...hooks import Replacement
from ...layouts import child, decoder_layers, layer_name, layout_of, part
from ...patching import stream_norms
from .rmsnorm import hf_layer_forward


def patch(model: torch.nn.Module) -> list[Replacement]:
    """Each decoder layer's forward (FP32 adds) and each norm reading the stream. The norm rounds to its weight's dtype:
    the run's dtype, or FP32 under AMP (--train-precision amp), where autocast rounds at the next GEMM instead."""
    found = []
    for norm in stream_norms(model, "hf"):
        child(norm, "weight", type(norm).__name__)
        child(norm, "variance_epsilon", type(norm).__name__)
        found.append(Replacement(norm, "forward", lambda h, norm=norm: normalize(
            h.float(), norm.weight, norm.variance_epsilon, norm.weight.dtype)))
    hf = layout_of(model, "hf")
    for i, layer in enumerate(decoder_layers(model, "hf")):
        for role in ("attn", "mlp"):
            part(layer, layer_name(hf, i), hf, role)
        found.append(Replacement(part(layer, "", hf, hf.regions["residual"]), "forward",
                                 hf_layer_forward(layer, hf, add=fp32_add)))
    return found
