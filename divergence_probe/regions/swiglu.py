"""SwiGLU, aligned: R(silu(float(gate)) * float(up)), one rounding instead of two.

As shipped, both transformers (`act_fn(gate_proj(x)) * up_proj(x)`) and vLLM (`SiluAndMul`, native or
fused kernel) round after silu and again after the product (2 R).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ProbeError
from ..stacks.hooks import Replacement
from .base import Region, child, decoder_layers


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def patch_hf(model: torch.nn.Module) -> list[Replacement]:
    if model.config.hidden_act != "silu":
        raise ProbeError(f"aligned SwiGLU needs hidden_act='silu', not {model.config.hidden_act!r}: leave swiglu "
                         "out of the aligned regions")
    found = []
    for i, layer in enumerate(decoder_layers(model)):
        mlp = child(layer, "mlp", f"model.model.layers[{i}]")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            child(mlp, proj, f"model.model.layers[{i}].mlp")
        found.append(Replacement(mlp, "forward",
                                 lambda x, mlp=mlp: mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x)))))
    return found


def patch_vllm(model: torch.nn.Module) -> list[Replacement]:
    """vLLM runs gate and up as one fused GEMM; SiluAndMul gets [..., 2*d] and splits it."""
    found = []
    for i, layer in enumerate(decoder_layers(model)):
        act = child(child(layer, "mlp", f"model.model.layers[{i}]"), "act_fn", f"model.model.layers[{i}].mlp")
        if type(act).__name__ != "SiluAndMul":
            raise ProbeError(f"aligned SwiGLU expects vLLM's SiluAndMul, found {type(act).__name__}: leave swiglu "
                             "out of the aligned regions")

        def forward(x):
            d = x.shape[-1] // 2
            return swiglu(x[..., :d], x[..., d:])

        found.append(Replacement(act, "_forward_method", forward))
    return found


SWIGLU = Region(
    name="swiglu",
    summary="SwiGLU: silu(gate)*up in FP32, one rounding at the output (shipped: 2 R on both stacks)",
    patchers={"hf": patch_hf, "vllm": patch_vllm},
)
