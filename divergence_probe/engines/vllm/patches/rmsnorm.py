"""RMSNorm on vLLM: its (fused add+) RMSNorm computes the region's norm of the FP32 sum with one rounding
(regions/rmsnorm.py)."""

from __future__ import annotations

import torch

from ....errors import ProbeError
from ....regions.rmsnorm import normalize
from ...hooks import Replacement


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


def patch(model: torch.nn.Module) -> list[Replacement]:
    return [vllm_norm(norm, "aligned RMSNorm supports full-width weighted norms only: leave rmsnorm out of the aligned "
                            "regions") for norm in model.modules() if type(norm).__name__ == "RMSNorm"]
