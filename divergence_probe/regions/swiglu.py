"""SwiGLU, aligned: R(silu(float(gate)) * float(up)), one rounding instead of two.

As shipped, both transformers (`act_fn(gate_proj(x)) * up_proj(x)`) and vLLM (`SiluAndMul`, native or
fused kernel) round after silu and again after the product (2 R).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ProbeError
from ..stacks.hooks import HookSet
from .base import Region


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def patch_hf(model: torch.nn.Module, hooks: HookSet) -> int:
    if model.config.hidden_act != "silu":
        raise ProbeError(f"aligned SwiGLU needs hidden_act='silu', not {model.config.hidden_act!r}")
    for layer in model.model.layers:
        mlp = layer.mlp
        hooks.replace(mlp, "forward", lambda x, mlp=mlp: mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x))))
    return len(model.model.layers)


def patch_vllm(model: torch.nn.Module, hooks: HookSet) -> int:
    """vLLM runs gate and up as one fused GEMM; SiluAndMul gets [..., 2*d] and splits it."""
    for layer in model.model.layers:
        act = layer.mlp.act_fn
        if type(act).__name__ != "SiluAndMul":
            raise ProbeError(f"aligned SwiGLU expects vLLM's SiluAndMul, found {type(act).__name__}")

        def forward(x):
            d = x.shape[-1] // 2
            return swiglu(x[..., :d], x[..., d:])

        hooks.replace(act, "_forward_method", forward)
    return len(model.model.layers)


SWIGLU = Region(
    name="swiglu",
    summary="SwiGLU: silu(gate)*up in FP32, one rounding at the output (shipped: 2 R on both stacks)",
    patchers={"hf": patch_hf, "vllm": patch_vllm},
)
