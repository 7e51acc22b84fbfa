"""SwiGLU on vLLM: its SiluAndMul computes the region's silu(gate)*up with one rounding (regions/swiglu.py)."""

from __future__ import annotations

import torch

from ....errors import ProbeError
from ....regions.swiglu import swiglu
from ...hooks import Replacement
from ...layouts import decoder_layers, layer_name, layout_of, part


def patch(model: torch.nn.Module) -> list[Replacement]:
    """vLLM runs gate and up as one fused GEMM; SiluAndMul gets [..., 2*d] and splits it."""
    found = []
    vllm = layout_of(model, "vllm")
    for i, layer in enumerate(decoder_layers(model, "vllm")):
        act = part(layer, layer_name(vllm, i), vllm, vllm.regions["swiglu"])
        if type(act).__name__ != "SiluAndMul":
            raise ProbeError(f"aligned SwiGLU expects vLLM's SiluAndMul, found {type(act).__name__}: leave swiglu "
                             "out of the aligned regions")

        def forward(x):
            d = x.shape[-1] // 2
            return swiglu(x[..., :d], x[..., d:])

        found.append(Replacement(act, "_forward_method", forward))
    return found
