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

from .base import Region


def normalize(s: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """s is FP32; one rounding to dtype at the end."""
    return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(dtype)


RMSNORM = Region(
    name="rmsnorm",
    summary="residual RMSNorm: FP32 residual sum into the norm, FP32 weight multiply, one rounding "
    "(shipped: 3 R on transformers, 2 R on vLLM); includes Qwen3's q_norm/k_norm",
)
