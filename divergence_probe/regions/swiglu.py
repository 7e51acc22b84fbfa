"""SwiGLU, aligned: R(silu(float(gate)) * float(up)), one rounding instead of two.

As shipped, both transformers (`act_fn(gate_proj(x)) * up_proj(x)`) and vLLM (`SiluAndMul`, native or
fused kernel) round after silu and again after the product (2 R).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Region


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


SWIGLU = Region(
    name="swiglu",
    summary="SwiGLU: silu(gate)*up in FP32, one rounding at the output (shipped: 2 R on both stacks)",
    exists_in=lambda family: "swiglu" in family.layer_taps,  # a dense MLP; a mixture of experts has none
)
