"""Qwen3-MoE: Qwen3's attention, and a sparse mixture-of-experts block in place of the dense MLP (transformers 5.x
`models/qwen3_moe/modeling_qwen3_moe.py`, vLLM `model_executor/models/qwen3_moe.py`; docs/design/moe.md has the facts
of both routers with file:line references).

Taps: Qwen3's up to `post_norm`, then `router_logits` (element 0 of `mlp.gate`'s output on both stacks: transformers'
router returns (logits, weights, ids), vLLM's GateLinear (logits, None); [tokens, experts], the batch flattened),
`mlp_out` (the MoE block's output) and `resid_out`. A sparse layer has no dense gate_proj/up_proj/swiglu, so the family
has none of those taps. Layers with a dense MLP among sparse ones (`mlp_only_layers`, `decoder_sparse_step`) are
refused by the checkpoint check (`fixed_config`) until the family chooses seams per layer.

vLLM fuses only q/k/v here; its experts are loaded by its own MoE loader, not through packed_modules_mapping: w13 holds
transformers' gate_up_proj (gate then up, per expert) and w2 its down_proj, then the CPU experts kernel prepacks both
into its tile order (`ENGINE_EXPERTS`; docs/design/moe.md).
"""

from __future__ import annotations

from dataclasses import replace

from .base import EngineExperts, ExpertTensors, Fused, Seam
from .qwen3 import CHECKPOINT as QWEN3_CHECKPOINT
from .qwen3 import QWEN3

_DENSE_MLP = ("gate_proj", "up_proj", "swiglu")
LAYER_TAPS = tuple(t for t in QWEN3.layer_taps if t not in _DENSE_MLP + ("mlp_out", "resid_out")) + (
    "router_logits", "mlp_out", "resid_out")
WIDTHS = {**{k: v for k, v in QWEN3.widths.items() if k not in _DENSE_MLP}, "router_logits": "experts"}

_MOE_ROLES = {"gate": "mlp.gate", "experts": "mlp.experts", "act": "mlp.experts"}


def _moe_seams(seams: tuple[Seam, ...], *routes: Seam) -> tuple[Seam, ...]:
    """The dense family's seams up to the MLP, then the router's logits (and `routes`, the router's choice) and the
    MoE block's output."""
    attention = tuple(s for s in seams if not set(s.taps) & set(_DENSE_MLP + ("mlp_out", "resid_out")))
    return attention + (Seam(("router_logits",), "gate", "rows"), *routes, Seam(("mlp_out",), "mlp")) + seams[-1:]


def _layer(roles: dict, dense: tuple[str, ...]) -> dict:
    return {**{k: v for k, v in roles.items() if k not in dense}, **_MOE_ROLES}


# transformers' router (`mlp.gate`) returns (logits, weights, ids): its weights and ids are its choice of experts
HF = replace(QWEN3.hf, layer=_layer(QWEN3.hf.layer, ("gate_proj", "up_proj", "down_proj", "act")),
             seams=_moe_seams(QWEN3.hf.seams, Seam(("expert_weights", "expert_ids"), "gate", "router_choice")),
             regions={"rope": "attn", "rmsnorm": "", "residual": ""})
# vLLM's router (`mlp.experts.router`, a BaseRouter, not a module): its select_experts returns (topk_weights, topk_ids),
# the experts vLLM then runs each row with, and calls the capture callback that fills enable_return_routed_experts.
VLLM = replace(QWEN3.vllm, layer={**_layer(QWEN3.vllm.layer, ("gate_up_proj", "down_proj", "act")),
                                  "router": "mlp.experts.router", "routed_experts": "mlp.experts.routed_experts"},
               seams=_moe_seams(QWEN3.vllm.seams, Seam(("expert_weights", "expert_ids"), "router", "select_experts")),
               regions={"rope": "rotary"})

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
ENGINE_EXPERTS = EngineExperts("routed_experts", {"w13_weight": "mlp.experts.gate_up_proj",
                                                  "w2_weight": "mlp.experts.down_proj"})

_WHY = "is not supported for Qwen3-MoE yet"
QWEN3_MOE = replace(
    QWEN3, model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", layer_taps=LAYER_TAPS, widths=WIDTHS, hf=HF,
    vllm=VLLM, fused=(Fused("qkv_proj", ("q_proj", "k_proj", "v_proj"), ("q", "kv", "kv")),), checkpoint=CHECKPOINT,
    required_config=("head_dim", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"),
    required_any=(("num_experts", "num_local_experts"),),
    fixed_config={"mlp_only_layers": [], "decoder_sparse_step": 1},
    experts=EXPERTS, engine_experts=ENGINE_EXPERTS, top_k_field="num_experts_per_tok",
    unsupported={f: _WHY for f in ("tensor_parallel_size > 1",)},
)
