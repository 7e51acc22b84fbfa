"""Where each canonical layer tap lives in vLLM's Qwen2/Qwen3 decoder layer: one table for the eager engine's hooks
(stacks/vllm.py) and the compiled engine's tap points (compiled_taps.py), so both read the same tensor at the same
seam.

A seam is a module, whether the tensor is one of its inputs (a forward-pre hook) or comes from its output (a forward
hook), and how to read the taps there. vLLM fuses some modules the canonical taps keep apart: q/k/v are one GEMM
(`qkv_proj`) and gate/up another (`gate_up_proj`), so their output splits along the features, in the order of the
model's packed_modules_mapping; the residual stream leaves a layer only inside the next fused add+norm, so
`resid_out` is formed from the layer's (hidden, residual) output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .hooks import arg, first_tensor

Read = Callable[[tuple, dict, object], dict[str, torch.Tensor]]  # (args, kwargs, output or None) -> {tap: tensor}


@dataclass(frozen=True)
class Seam:
    names: tuple[str, ...]  # the canonical taps read here
    module: torch.nn.Module
    before: bool  # an input of the module (forward-pre hook), else from its output (forward hook)
    read: Read


class FusedSplit:
    """How one of vLLM's fused GEMM outputs splits into canonical taps, along the features, in the order of the
    model's packed_modules_mapping (qkv_proj = q, k, v; gate_up_proj = gate, up)."""

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


def _layer_output(a, k, o) -> dict[str, torch.Tensor]:
    hidden, residual = o
    return {"resid_out": (hidden.float() + residual.float()).to(hidden.dtype)}


def layer_seams(layer) -> list[Seam]:
    """Every layer tap's seam in one decoder layer, in the order its forward reaches them (q_norm/k_norm only where
    the model has them, Qwen3)."""
    attn, mlp = layer.self_attn, layer.mlp
    seams = [
        Seam(("input_norm",), layer.input_layernorm, False, _output("input_norm")),
        Seam(("q_proj", "k_proj", "v_proj"), attn.qkv_proj, False,
             _split(FusedSplit(("q_proj", "k_proj", "v_proj"), [attn.q_size, attn.kv_size, attn.kv_size]))),
        Seam(("q_rope",), attn.attn, True, _input("q_rope", 0, "query")),
        Seam(("k_rope",), attn.attn, True, _input("k_rope", 1, "key")),
        Seam(("attn_core",), attn.attn, False, _output("attn_core")),
        Seam(("attn_out",), attn.o_proj, False, _output("attn_out")),
        Seam(("resid_mid",), layer.post_attention_layernorm, False, _output("resid_mid", lambda o: o[1])),
        Seam(("post_norm",), layer.post_attention_layernorm, False, _output("post_norm")),
        Seam(("gate_proj", "up_proj"), mlp.gate_up_proj, False, _split(FusedSplit(("gate_proj", "up_proj")))),
        Seam(("swiglu",), mlp.down_proj, True, _input("swiglu", 0, "input_")),
        Seam(("mlp_out",), mlp.down_proj, False, _output("mlp_out")),
        Seam(("resid_out",), layer, False, _layer_output),
    ]
    for name in ("q_norm", "k_norm"):
        if getattr(attn, name, None) is not None:
            seams.insert(2, Seam((name,), getattr(attn, name), False, _output(name)))
    return seams
