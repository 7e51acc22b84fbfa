"""RoPE on vLLM: its RotaryEmbedding computes the region's FP32 rotation (regions/rope.py has the math and where vLLM
rounds as shipped)."""

from __future__ import annotations

import torch

from ....errors import ProbeError
from ....regions.rope import cos_sin, inv_freq, rotate
from ...hooks import Replacement
from ...layouts import decoder_layers, layer_name, layout_of, part


def patch(model: torch.nn.Module) -> list[Replacement]:
    """vLLM shares one RotaryEmbedding instance between layers; its dispatched forward is replaced."""
    found = {}
    vllm = layout_of(model, "vllm")
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
