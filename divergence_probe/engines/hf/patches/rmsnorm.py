"""RMSNorm on transformers: every RMSNorm normalises the FP32 residual sum and rounds once, and each decoder layer's
forward is the same dataflow written with explicit residual adds that hand the sum on (regions/rmsnorm.py)."""

from __future__ import annotations

import torch

from ....models import find
from ....regions.rmsnorm import normalize
from ...hooks import Replacement
from ...layouts import SeamMissing, StackLayout, child, decoder_layers, layer_name, layout_of, part

_FP32_SUM = "_divergence_probe_fp32_sum"


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


def patch(model: torch.nn.Module) -> list[Replacement]:
    """Every RMSNorm (layer norms, q_norm/k_norm, the final norm) and every decoder layer's forward."""
    found = []
    for name, norm in model.named_modules():
        if type(norm).__name__.endswith("RMSNorm"):
            child(norm, "weight", name)
            child(norm, "variance_epsilon", name)
            found.append(Replacement(norm, "forward", _hf_norm_forward(norm)))
    if not found:
        raise SeamMissing("RMSNorm module (a *RMSNorm) anywhere in the model")
    hf = layout_of(model, "hf")
    for i, layer in enumerate(decoder_layers(model, "hf")):
        for role in ("input_norm", "attn", "post_norm", "mlp"):
            part(layer, layer_name(hf, i), hf, role)
        found.append(Replacement(part(layer, "", hf, hf.regions["rmsnorm"]), "forward", hf_layer_forward(layer, hf)))
    return found
