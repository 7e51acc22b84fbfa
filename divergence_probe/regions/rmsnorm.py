"""Residual RMSNorm, aligned: the norm sees the FP32 residual sum and rounds once at its output.

    s = float(x) + float(residual)          (first layer / q_norm / k_norm: s = float(x))
    residual_out = R(s)                     the residual stream itself stays in the run's dtype
    out = R(s * rsqrt(mean(s²) + eps) * float(weight))

As shipped, transformers adds the residual in BF16 (R), normalises the *rounded* sum, rounds, then
multiplies by the weight in BF16 (R): 3 R. vLLM's native fused add+norm already normalises the FP32 sum
but also rounds before the weight multiply (2 R). Qwen3's per-head q_norm/k_norm belong to this region.

On transformers the residual add is inline code in the decoder layer, so the layer forward is replaced by
the same dataflow written explicitly; the FP32 sum has to reach the *next* layer's input norm (and the final
norm), and the decoder loop passes one tensor between layers, so the rounded stream tensor carries its
unrounded sum as an attribute that only the aligned norms read.
"""

from __future__ import annotations

import torch

from ..errors import ProbeError
from ..models import StackLayout, find
from ..engines.hooks import Replacement
from .base import Region, SeamMissing, child, decoder_layers, layer_name, layout, part

_FP32_SUM = "_divergence_probe_fp32_sum"


def normalize(s: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """s is FP32; one rounding to dtype at the end."""
    return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             stream_dtype: torch.dtype | None = None):
    """The aligned norm in vLLM's calling convention: out, or (out, new residual) when residual is given, the new
    residual in `stream_dtype` (x's by default: vLLM's stream; FP32 for the residual region's)."""
    if residual is None:
        return normalize(x.float(), weight, eps, x.dtype)
    s = x.float() + residual.float()
    return normalize(s, weight, eps, x.dtype), s.to(stream_dtype or x.dtype)


def vllm_norm(norm, refusal: str, **options) -> Replacement:
    """vLLM's RMSNorm `norm` computing as `rms_norm(..., **options)`; any other norm (another class, a variance over
    part of the width, no weight) is refused with `refusal` ({norm} names it)."""
    if type(norm).__name__ != "RMSNorm" or getattr(norm, "variance_size_override", None) is not None \
            or not getattr(norm, "has_weight", True):
        raise ProbeError(refusal.format(norm=repr(norm)))
    return Replacement(norm, "_forward_method", lambda x, residual=None: rms_norm(
        x, norm.weight.data, norm.variance_epsilon, residual, **options))


def residual_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """R(float(x) + float(residual)), carrying the FP32 sum for the next aligned norm."""
    s = x.float() + residual.float()
    out = s.to(x.dtype)
    setattr(out, _FP32_SUM, s)
    return out


def _hf_norm_forward(norm):
    def forward(hidden_states):
        s = getattr(hidden_states, _FP32_SUM, None)
        return normalize(hidden_states.float() if s is None else s, norm.weight, norm.variance_epsilon, hidden_states.dtype)

    return forward


def hf_layer_forward(layer, hf: StackLayout, add=residual_add):
    """transformers' Qwen2/Qwen3 decoder layer, with both residual adds through `add` (residual_add here; the residual
    region's keeps the stream in FP32). Its parts are looked up per call, as the layer's own forward does: a replay
    (engines/hf/replay.py) stubs them."""
    paths = {role: hf.layer[role] for role in ("input_norm", "attn", "post_norm", "mlp")}

    def forward(hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        x = find(layer, paths["input_norm"])(hidden_states)
        x, _ = find(layer, paths["attn"])(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                                          past_key_values=past_key_values, use_cache=use_cache,
                                          position_embeddings=position_embeddings, **kwargs)
        residual = add(x, residual)
        x = find(layer, paths["mlp"])(find(layer, paths["post_norm"])(residual))
        return add(x, residual)

    return forward


def patch_hf(model: torch.nn.Module) -> list[Replacement]:
    """Every RMSNorm (layer norms, q_norm/k_norm, the final norm) and every decoder layer's forward."""
    found = []
    for name, norm in model.named_modules():
        if type(norm).__name__.endswith("RMSNorm"):
            child(norm, "weight", name)
            child(norm, "variance_epsilon", name)
            found.append(Replacement(norm, "forward", _hf_norm_forward(norm)))
    if not found:
        raise SeamMissing("RMSNorm module (a *RMSNorm) anywhere in the model")
    hf = layout(model, "hf")
    for i, layer in enumerate(decoder_layers(model, "hf")):
        for role in ("input_norm", "attn", "post_norm", "mlp"):
            part(layer, layer_name(hf, i), hf, role)
        found.append(Replacement(part(layer, "", hf, hf.regions["rmsnorm"]), "forward", hf_layer_forward(layer, hf)))
    return found


def patch_vllm(model: torch.nn.Module) -> list[Replacement]:
    return [vllm_norm(norm, "aligned RMSNorm supports full-width weighted norms only: leave rmsnorm out of the aligned "
                            "regions") for norm in model.modules() if type(norm).__name__ == "RMSNorm"]


RMSNORM = Region(
    name="rmsnorm",
    summary="residual RMSNorm: FP32 residual sum into the norm, FP32 weight multiply, one rounding "
    "(shipped: 3 R on transformers, 2 R on vLLM); includes Qwen3's q_norm/k_norm",
    patchers={"hf": patch_hf, "vllm": patch_vllm},
)
