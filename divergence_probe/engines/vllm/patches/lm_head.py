"""The FP32 head on vLLM: its LogitsProcessor's head GEMM computes the region's FP32 logits (regions/lm_head.py)."""

from __future__ import annotations

import torch

from ....errors import ProbeError
from ....regions.lm_head import head
from ...hooks import Replacement
from ...layouts import child, model_part


def patch(model: torch.nn.Module) -> list[Replacement]:
    """vLLM's LogitsProcessor calls `lm_head.quant_method.apply(lm_head, hidden, bias)` for the head GEMM; that call is
    replaced. With a `head_dtype` other than the model's (its own FP32-head option) the processor skips it, so
    that engine is refused rather than silently left as it runs."""
    lm_head = model_part(model, "vllm", "lm_head")
    method = child(lm_head, "quant_method", "the lm_head")
    if type(method).__name__ not in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"):
        raise ProbeError(f"an FP32 head needs an unquantized lm_head; vLLM built {type(method).__name__}: leave "
                         "lm_head out of the aligned regions")
    for module in model.modules():
        head_dtype = getattr(module, "head_dtype", None) if type(module).__name__ == "LogitsProcessor" else None
        if head_dtype is not None and head_dtype != lm_head.weight.dtype:
            raise ProbeError(f"the engine already runs its head in {head_dtype} (head_dtype in the checkpoint's "
                             "config.json, which vLLM reads): remove it there, or leave lm_head out of the aligned "
                             "regions")
    return [Replacement(method, "apply", lambda layer, x, bias=None: head(x, layer.weight, bias))]
