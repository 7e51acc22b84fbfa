"""Where transformers (5.x) keeps each family's modules, and where the trainer's hooks read each tap.

transformers has no module boundary between RoPE and attention, so q_rope/k_rope/attn_core are read inside the
attention function (engines/hf/trainer.py); the residual stream is read at the post-attention norm's input and the
decoder layer's output. Qwen3 adds its per-head q_norm/k_norm after the projections; Qwen3-MoE's router (`mlp.gate`)
returns (logits, weights, ids), and its weights and ids are its choice of experts.
"""

from __future__ import annotations

from dataclasses import replace

from ..layouts import Seam, StackLayout, insert_after, moe_seams, without

MODEL = {"decoder": "model", "embed": "model.embed_tokens", "layers": "model.layers", "final_norm": "model.norm",
         "lm_head": "lm_head"}

QWEN2 = StackLayout(
    model={**MODEL, "rotary": "model.rotary_emb"},
    layer={"input_norm": "input_layernorm", "attn": "self_attn", "q_proj": "self_attn.q_proj",
           "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
           "post_norm": "post_attention_layernorm", "mlp": "mlp", "gate_proj": "mlp.gate_proj",
           "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj", "act": "mlp.act_fn"},
    seams=(
        Seam(("input_norm",), "input_norm"),
        Seam(("q_proj",), "q_proj", "projection"),
        Seam(("k_proj",), "k_proj", "projection"),
        Seam(("v_proj",), "v_proj", "projection"),
        Seam(("q_rope", "k_rope", "attn_core"), "attn", "attention"),  # inside the attention function
        Seam(("attn_out",), "o_proj", "projection"),
        Seam(("resid_mid",), "post_norm", "input", (0, "hidden_states")),
        Seam(("post_norm",), "post_norm"),
        Seam(("gate_proj",), "gate_proj", "projection"),
        Seam(("up_proj",), "up_proj", "projection"),
        Seam(("swiglu",), "down_proj", "projection_input", (0, "input")),
        Seam(("mlp_out",), "down_proj", "projection"),
        Seam(("resid_out",), ""),
    ),
    # rope: the attention's modeling file holds apply_rotary_pos_emb; rmsnorm, residual: the layer forward (its adds)
    regions={"rope": "attn", "swiglu": "mlp", "rmsnorm": "", "residual": ""},
)

QWEN3 = replace(QWEN2, layer={**QWEN2.layer, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
                seams=insert_after(QWEN2.seams, "v_proj", Seam(("q_norm",), "q_norm", "heads"),
                                   Seam(("k_norm",), "k_norm", "heads")))

QWEN3_MOE = replace(
    QWEN3, layer={**without(QWEN3.layer, ("gate_proj", "up_proj", "down_proj", "act")),
                  "gate": "mlp.gate", "experts": "mlp.experts", "act": "mlp.experts"},
    seams=moe_seams(QWEN3.seams, Seam(("router_logits",), "gate", "rows"),
                    Seam(("expert_weights", "expert_ids"), "gate", "router_choice")),
    regions={"rope": "attn", "rmsnorm": "", "residual": ""})

LAYOUTS = {"qwen2": QWEN2, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE}
