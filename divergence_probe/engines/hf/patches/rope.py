"""RoPE on transformers: the rotary module returns the region's FP32 half-width cos/sin, and the modeling file's
apply_rotary_pos_emb rotates with them (regions/rope.py has the math and where transformers rounds as shipped)."""

from __future__ import annotations

import sys

import torch

from ....errors import ProbeError
from ....regions.rope import cos_sin, inv_freq, rotate
from ...hooks import Replacement
from ...layouts import SeamMissing, child, decoder_layers, layer_name, layout_of, part


def patch(model: torch.nn.Module) -> list[Replacement]:
    """The rotary module returns FP32 half-width cos/sin; the modeling file's apply_rotary_pos_emb rotates
    with them in FP32. The half width is the marker, so any other model in the process is unaffected."""
    rotaries = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not rotaries:
        raise SeamMissing("rotary embedding module (a *RotaryEmbedding) anywhere in the model")
    freqs = frequencies(model)
    found = []
    for rotary in rotaries:
        if getattr(rotary, "rope_type", "default") != "default" or getattr(rotary, "attention_scaling", 1.0) != 1.0:
            raise ProbeError(f"aligned RoPE supports default RoPE only; this model uses {rotary.rope_type!r}: "
                             "leave rope out of the aligned regions")
        found.append(Replacement(rotary, "forward", lambda x, position_ids: cos_sin(position_ids, freqs)))
    modelings = {}
    hf = layout_of(model, "hf")
    for i, layer in enumerate(decoder_layers(model, "hf")):
        modeling = sys.modules[type(part(layer, layer_name(hf, i), hf, hf.regions["rope"])).__module__]
        modelings[modeling.__name__] = modeling
    for modeling in modelings.values():
        shipped = child(modeling, "apply_rotary_pos_emb", modeling.__name__)
        if not getattr(shipped, "_aligned", False):  # else a live patch of another model of the class did it
            found.append(Replacement(modeling, "apply_rotary_pos_emb", _dispatching(shipped), shared=True))
    return found


def frequencies(model: torch.nn.Module) -> torch.Tensor:
    """The model's RoPE inverse frequencies in FP32, on its device (regions/rope.py inv_freq)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return inv_freq(config.rope_parameters["rope_theta"], head_dim, device=model.device)


def _dispatching(shipped):
    """apply_rotary_pos_emb that rotates in FP32 when handed half-width cos/sin, else runs the shipped one."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        if cos.shape[-1] * 2 != q.shape[-1]:
            return shipped(q, k, cos, sin, unsqueeze_dim, **kwargs)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)  # [B, 1, T, d/2]
        return rotate(q, cos, sin), rotate(k, cos, sin)

    apply_rotary_pos_emb._aligned = True
    return apply_rotary_pos_emb
