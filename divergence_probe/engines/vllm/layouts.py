"""Where vLLM keeps each family's modules, where its hooks read each tap, and what it fuses.

vLLM (`model_executor/models/qwen2.py`, `qwen3.py`, `qwen3_moe.py`; docs/numerics.md has the map) fuses q/k/v into
one GEMM and gate/up into another (its packed_modules_mapping), fuses each residual add into the next RMSNorm (so the
residual stream is read from the norm's second output) and receives q/k after RoPE as the inputs of its Attention
module. Qwen3 adds its per-head q_norm/k_norm after the fused projection.

In Qwen3-MoE only q/k/v are packed; the experts are loaded by vLLM's own MoE loader: w13 holds transformers'
gate_up_proj (gate then up, per expert) and w2 its down_proj, then the CPU experts kernel prepacks both into its tile
order (docs/design/moe.md). Its router (`mlp.experts.router`, a BaseRouter, not a module) has select_experts return
(topk_weights, topk_ids), the experts vLLM then runs each row with.
"""

from __future__ import annotations

from dataclasses import replace

from ..layouts import EngineExperts, Fused, Seam, StackLayout, insert_after, moe_seams, without

MODEL = {"decoder": "model", "embed": "model.embed_tokens", "layers": "model.layers", "final_norm": "model.norm",
         "lm_head": "lm_head"}
_QKV = Fused("qkv_proj", ("q_proj", "k_proj", "v_proj"), ("q", "kv", "kv"))

QWEN2 = StackLayout(
    model=MODEL,
    layer={"input_norm": "input_layernorm", "attn": "self_attn", "qkv_proj": "self_attn.qkv_proj",
           "attention": "self_attn.attn", "rotary": "self_attn.rotary_emb", "o_proj": "self_attn.o_proj",
           "post_norm": "post_attention_layernorm", "mlp": "mlp", "gate_up_proj": "mlp.gate_up_proj",
           "down_proj": "mlp.down_proj", "act": "mlp.act_fn"},
    seams=(
        Seam(("input_norm",), "input_norm"),
        Seam(("q_proj", "k_proj", "v_proj"), "qkv_proj", "split"),
        Seam(("q_rope",), "attention", "input", (0, "query")),
        Seam(("k_rope",), "attention", "input", (1, "key")),
        Seam(("attn_core",), "attention"),
        Seam(("attn_out",), "o_proj"),
        Seam(("resid_mid",), "post_norm", "residual"),  # the fused add+norm's second output
        Seam(("post_norm",), "post_norm"),
        Seam(("gate_proj", "up_proj"), "gate_up_proj", "split"),
        Seam(("swiglu",), "down_proj", "input", (0, "input_")),
        Seam(("mlp_out",), "down_proj"),
        Seam(("resid_out",), "", "layer_sum"),  # hidden + residual: the stream leaves only inside the next norm
    ),
    regions={"rope": "rotary", "swiglu": "act"},  # rmsnorm: every RMSNorm module, found by type
    fused=(_QKV, Fused("gate_up_proj", ("gate_proj", "up_proj"))),
)

QWEN3 = replace(QWEN2, layer={**QWEN2.layer, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
                seams=insert_after(QWEN2.seams, "qkv_proj", Seam(("q_norm",), "q_norm"),
                                   Seam(("k_norm",), "k_norm")))

QWEN3_MOE = replace(
    QWEN3, layer={**without(QWEN3.layer, ("gate_up_proj", "down_proj", "act")),
                  "gate": "mlp.gate", "experts": "mlp.experts", "act": "mlp.experts",
                  "router": "mlp.experts.router", "routed_experts": "mlp.experts.routed_experts"},
    seams=moe_seams(QWEN3.seams, Seam(("router_logits",), "gate", "rows"),
                    Seam(("expert_weights", "expert_ids"), "router", "select_experts")),
    regions={"rope": "rotary"},
    fused=(_QKV,),
    experts=EngineExperts("routed_experts", {"w13_weight": "mlp.experts.gate_up_proj",
                                             "w2_weight": "mlp.experts.down_proj"}))

LAYOUTS = {"qwen2": QWEN2, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE}
