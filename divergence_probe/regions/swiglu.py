"""SwiGLU, aligned: R(silu(float(gate)) * float(up)), one rounding instead of two.

As shipped, both transformers (`act_fn(gate_proj(x)) * up_proj(x)`) and vLLM (`SiluAndMul`, native or
fused kernel) round after silu and again after the product (2 R).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ProbeError
from ..models import find
from ..engines.hooks import Replacement
from .base import Region, decoder_layers, layer_name, layout, part


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def patch_hf(model: torch.nn.Module) -> list[Replacement]:
    if model.config.hidden_act != "silu":
        raise ProbeError(f"aligned SwiGLU needs hidden_act='silu', not {model.config.hidden_act!r}: leave swiglu "
                         "out of the aligned regions")
    found = []
    hf = layout(model, "hf")
    for i, layer in enumerate(decoder_layers(model, "hf")):
        where = layer_name(hf, i)
        mlp = part(layer, where, hf, hf.regions["swiglu"])
        for role in ("gate_proj", "up_proj", "down_proj"):
            part(layer, where, hf, role)
        gate, up, down = (hf.layer[role] for role in ("gate_proj", "up_proj", "down_proj"))

        def forward(x, layer=layer, gate=gate, up=up, down=down):  # looked up per call: a replay stubs them
            return find(layer, down)(swiglu(find(layer, gate)(x), find(layer, up)(x)))

        found.append(Replacement(mlp, "forward", forward))
    return found


def patch_vllm(model: torch.nn.Module) -> list[Replacement]:
    """vLLM runs gate and up as one fused GEMM; SiluAndMul gets [..., 2*d] and splits it."""
    found = []
    vllm = layout(model, "vllm")
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


SWIGLU = Region(
    name="swiglu",
    summary="SwiGLU: silu(gate)*up in FP32, one rounding at the output (shipped: 2 R on both stacks)",
    patchers={"hf": patch_hf, "vllm": patch_vllm},
    exists_in=lambda family: "swiglu" in family.hf.regions,  # a dense MLP; a mixture of experts has none
)
