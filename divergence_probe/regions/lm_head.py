"""LM head in FP32: logits = float(h) @ float(W)ᵀ, accumulated and returned in FP32, never rounded.

The fix RL teams ship as an FP32 head (MiniMax-M1; TRL's `cast_lm_head_to_fp32`; vLLM's own
`hf_overrides={"head_dtype": "float32"}`). As shipped, both stacks run the head GEMM in the run's dtype and return
BF16 logits (one R per logit, after an accumulation whose order each GEMM kernel picks); both then take log_softmax
of the exactly upcast logits. Aligned, the final norm's output (the run's dtype, upcast exactly) meets the FP32 cast
of the weight, and the FP32 logits go straight to each stack's log_softmax: compare's logprobs and KL are computed
from them with no rounding to the run's dtype in between. Unlike the other regions nothing is rounded at the output:
the logits leave the network here, and an FP32 softmax is what follows on both sides.

vLLM computes logits outside its compiled graph (the runner calls `compute_logits` eagerly after the model's
forward), so a compiled engine runs this patch as Python at every step, as an eager one does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ProbeError
from ..engines.hooks import Replacement
from .base import Region, child, model_part


def head(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[..., hidden] in any dtype -> [..., vocab] FP32 logits (the upcasts are exact; one FP32 GEMM). Autocast is off
    here: a trainer under AMP (--train-precision amp) would otherwise run this GEMM in its low precision."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def patch_hf(model: torch.nn.Module) -> list[Replacement]:
    """transformers' head is an nn.Linear whose output the causal LM returns as its logits."""
    lm_head = model_part(model, "hf", "lm_head")
    child(lm_head, "weight", "the lm_head")
    return [Replacement(lm_head, "forward", lambda x: head(x, lm_head.weight, lm_head.bias))]


def patch_vllm(model: torch.nn.Module) -> list[Replacement]:
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


LM_HEAD = Region(
    name="lm_head",
    summary="LM head: FP32 GEMM of the upcast final hidden state, FP32 logits into the softmax, no rounding "
    "(shipped: the head GEMM in the run's dtype, 1 R per logit, on both stacks)",
    patchers={"hf": patch_hf, "vllm": patch_vllm},
    outside_graph=True,
)
