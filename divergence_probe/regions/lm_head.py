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

from .base import Region


def head(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[..., hidden] in any dtype -> [..., vocab] FP32 logits (the upcasts are exact; one FP32 GEMM). Autocast is off
    here: a trainer under AMP (--train-precision amp) would otherwise run this GEMM in its low precision."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


LM_HEAD = Region(
    name="lm_head",
    summary="LM head: FP32 GEMM of the upcast final hidden state, FP32 logits into the softmax, no rounding "
    "(shipped: the head GEMM in the run's dtype, 1 R per logit, on both stacks)",
    outside_graph=True,
)
