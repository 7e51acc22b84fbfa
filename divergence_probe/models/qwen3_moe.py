"""Qwen3-MoE: Qwen3's attention, and a sparse mixture-of-experts block in place of the dense MLP (transformers 5.x
`models/qwen3_moe/modeling_qwen3_moe.py`, vLLM `model_executor/models/qwen3_moe.py`; docs/design/moe.md has the facts
of both routers with file:line references).

Taps: Qwen3's up to `post_norm`, then `router_logits` (the router's logits, [tokens, experts], the batch flattened),
`mlp_out` (the MoE block's output) and `resid_out`. A sparse layer has no dense gate_proj/up_proj/swiglu, so the family
has none of those taps. Layers with a dense MLP among sparse ones (`mlp_only_layers`, `decoder_sparse_step`) are
refused by the checkpoint check (`fixed_config`) until the family chooses seams per layer.

A checkpoint stores the experts either as transformers' fused parameters (gate_up_proj: gate then up, per expert;
down_proj) or as per-expert tensors (`EXPERTS`); where an engine's MoE loader puts them is its layout.
"""

from __future__ import annotations

from dataclasses import replace

from .base import ExpertTensors
from .qwen3 import CHECKPOINT as QWEN3_CHECKPOINT
from .qwen3 import QWEN3

_DENSE_MLP = ("gate_proj", "up_proj", "swiglu")
LAYER_TAPS = tuple(t for t in QWEN3.layer_taps if t not in _DENSE_MLP + ("mlp_out", "resid_out")) + (
    "router_logits", "mlp_out", "resid_out")
WIDTHS = {**{k: v for k, v in QWEN3.widths.items() if k not in _DENSE_MLP}, "router_logits": "experts"}

_EXPERTS = ("num_experts", "hidden_size")
CHECKPOINT = {**{k: v for k, v in QWEN3_CHECKPOINT.items() if not k.startswith("mlp.")},
              "mlp.gate.weight": _EXPERTS,
              "mlp.experts.gate_up_proj": ("num_experts", "moe_intermediate_size", "hidden_size"),
              "mlp.experts.down_proj": ("num_experts", "hidden_size", "moe_intermediate_size"),
              "mlp.experts.*.gate_proj.weight": ("moe_intermediate_size", "hidden_size"),
              "mlp.experts.*.up_proj.weight": ("moe_intermediate_size", "hidden_size"),
              "mlp.experts.*.down_proj.weight": ("hidden_size", "moe_intermediate_size")}
EXPERTS = (ExpertTensors("mlp.experts.gate_up_proj", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
           ExpertTensors("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)))

_WHY = "is not supported for Qwen3-MoE yet"
QWEN3_MOE = replace(
    QWEN3, model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", layer_taps=LAYER_TAPS, widths=WIDTHS,
    checkpoint=CHECKPOINT,
    required_config=("head_dim", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"),
    required_any=(("num_experts", "num_local_experts"),),
    fixed_config={"mlp_only_layers": [], "decoder_sparse_step": 1},
    experts=EXPERTS, top_k_field="num_experts_per_tok",
    unsupported={f: _WHY for f in ("tensor_parallel_size > 1",)},
)
