"""RoPE, aligned: FP32 angles, FP32 cos/sin (never rounded), FP32 rotation, one rounding per output element.

As shipped, transformers rounds cos/sin to BF16 and then rounds `q*cos`, `rotate_half(q)*sin` and their
sum (3 R); vLLM's CPU/CUDA kernels do FP32 math on a BF16 cos/sin cache and convert once (on AVX2 CPUs
by truncation). Aligned: out = R(x1*c - x2*s, x2*c + x1*s) with c, s = cos, sin(position * inv_freq) in FP32,
inv_freq = 1 / base**(arange(0, d, 2)/d) in FP32 (the formula both stacks use for default RoPE).
Only default ("neox", rotate-half) RoPE over the full head is supported; other rope types raise.
"""

from __future__ import annotations

import torch

from .base import Region


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


ROPE = Region(
    name="rope",
    summary="RoPE: FP32 cos/sin and rotation, one rounding at the output (shipped: 3 R on transformers)",
)
