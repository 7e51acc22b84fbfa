"""The FP32 residual stream on vLLM: the fused add+norm of every norm reading the stream returns the FP32 sum as the
residual (regions/residual.py)."""

from __future__ import annotations

import torch

from ...hooks import Replacement
from ...patching import stream_norms
from .rmsnorm import vllm_norm


def patch(model: torch.nn.Module) -> list[Replacement]:
    """The fused add+RMSNorm of each norm reading the stream (vLLM's layers pass `residual` through them alone)."""
    return [vllm_norm(norm, "an FP32 residual stream needs vLLM's full-width weighted RMSNorm, found {norm}: leave "
                            "residual out of the aligned regions", stream_dtype=torch.float32)
            for norm in stream_norms(model, "vllm")]
