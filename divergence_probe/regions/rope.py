"""RoPE, aligned: FP32 angles, FP32 cos/sin (never rounded), FP32 rotation, one rounding per output element.

As shipped, transformers rounds cos/sin to BF16 and then rounds `q*cos`, `rotate_half(q)*sin` and their
sum (3 R); vLLM's CPU/CUDA kernels do FP32 math on a BF16 cos/sin cache and convert once (on AVX2 CPUs
by truncation). Aligned: out = R(x1*c - x2*s, x2*c + x1*s) with c, s = cos, sin(position * inv_freq) in FP32,
inv_freq = 1 / base**(arange(0, d, 2)/d) in FP32 (the formula both stacks use for default RoPE).
Only default ("neox", rotate-half) RoPE over the full head is supported; other rope types raise.
"""

from __future__ import annotations

import sys

import torch

from ..errors import ProbeError
from ..engines.hooks import Replacement
from .base import Region, SeamMissing, child, decoder_layers, layer_name, layout, part


def inv_freq(base: float, dim: int, device=None) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos/sin of shape [*positions.shape, d/2]; the half-width marks them as aligned (see patch_hf)."""
    angles = positions.float()[..., None] * freqs
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] in any dtype; cos/sin FP32, broadcastable to [..., d/2]. One rounding, at the output."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def patch_hf(model: torch.nn.Module) -> list[Replacement]:
    """The rotary module returns FP32 half-width cos/sin; the modeling file's apply_rotary_pos_emb rotates
    with them in FP32. The half width is the marker, so any other model in the process is unaffected."""
    rotaries = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not rotaries:
        raise SeamMissing("rotary embedding module (a *RotaryEmbedding) anywhere in the model")
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = inv_freq(config.rope_parameters["rope_theta"], head_dim, device=model.device)
    found = []
    for rotary in rotaries:
        if getattr(rotary, "rope_type", "default") != "default" or getattr(rotary, "attention_scaling", 1.0) != 1.0:
            raise ProbeError(f"aligned RoPE supports default RoPE only; this model uses {rotary.rope_type!r}: "
                             "leave rope out of the aligned regions")
        found.append(Replacement(rotary, "forward", lambda x, position_ids: cos_sin(position_ids, freqs)))
    modelings = {}
    hf = layout(model, "hf")
    for i, layer in enumerate(decoder_layers(model, "hf")):
        modeling = sys.modules[type(part(layer, layer_name(hf, i), hf, hf.regions["rope"])).__module__]
        modelings[modeling.__name__] = modeling
    for modeling in modelings.values():
        shipped = child(modeling, "apply_rotary_pos_emb", modeling.__name__)
        if not getattr(shipped, "_aligned", False):  # else a live patch of another model of the class did it
            found.append(Replacement(modeling, "apply_rotary_pos_emb", _dispatching(shipped), shared=True))
    return found


def _dispatching(shipped):
    """apply_rotary_pos_emb that rotates in FP32 when handed half-width cos/sin, else runs the shipped one."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        if cos.shape[-1] * 2 != q.shape[-1]:
            return shipped(q, k, cos, sin, unsqueeze_dim, **kwargs)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)  # [B, 1, T, d/2]
        return rotate(q, cos, sin), rotate(k, cos, sin)

    apply_rotary_pos_emb._aligned = True
    return apply_rotary_pos_emb


def patch_vllm(model: torch.nn.Module) -> list[Replacement]:
    """vLLM shares one RotaryEmbedding instance between layers; its dispatched forward is replaced."""
    found = {}
    vllm = layout(model, "vllm")
    for i, layer in enumerate(decoder_layers(model, "vllm")):
        rope = part(layer, layer_name(vllm, i), vllm, vllm.regions["rope"])
        if id(rope) in found:
            continue
        if type(rope).__name__ != "RotaryEmbedding" or not rope.is_neox_style or rope.rotary_dim != rope.head_size:
            raise ProbeError(f"aligned RoPE supports default neox RoPE over the full head; vLLM built {rope!r}: "
                             "leave rope out of the aligned regions")
        freqs = inv_freq(rope.base, rope.head_size, device=rope.cos_sin_cache.device)

        def forward(positions, query, key=None, *args, _rope=rope, _freqs=freqs):
            cos, sin = cos_sin(positions, _freqs)
            cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, d/2] against [T, heads, d]
            d = _rope.head_size
            q = rotate(query.view(query.shape[0], -1, d), cos, sin).view(query.shape)
            k = None if key is None else rotate(key.view(key.shape[0], -1, d), cos, sin).view(key.shape)
            return q, k

        found[id(rope)] = Replacement(rope, "_forward_method", forward)
    return list(found.values())


ROPE = Region(
    name="rope",
    summary="RoPE: FP32 cos/sin and rotation, one rounding at the output (shipped: 3 R on transformers)",
    patchers={"hf": patch_hf, "vllm": patch_vllm},
)
