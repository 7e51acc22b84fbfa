"""Qwen2 (Qwen2.5): pre-norm decoder layer, GQA attention with q/k/v biases, SwiGLU MLP, residual RMSNorm.

transformers 5.x `models/qwen2/modeling_qwen2.py` and vLLM `model_executor/models/qwen2.py` (docs/numerics.md
has the map of both). vLLM fuses q/k/v into one GEMM and gate/up into another (its packed_modules_mapping), fuses
each residual add into the next RMSNorm (so the residual stream is read from the norm's second output), and
receives q/k after RoPE as the inputs of its Attention module; transformers has no module boundary there, so its
q_rope/k_rope/attn_core are read inside the attention function (engines/hf/trainer.py).
"""

from __future__ import annotations

from .base import Family, Fused, Seam, StackLayout

LAYER_TAPS = ("input_norm", "q_proj", "k_proj", "v_proj", "q_rope", "k_rope", "attn_core", "attn_out", "resid_mid",
              "post_norm", "gate_proj", "up_proj", "swiglu", "mlp_out", "resid_out")
WIDTHS = {"input_norm": "hidden", "q_proj": "q", "k_proj": "kv", "v_proj": "kv", "q_norm": "q", "k_norm": "kv",
          "q_rope": "q", "k_rope": "kv", "attn_core": "q", "attn_out": "hidden", "resid_mid": "hidden",
          "post_norm": "hidden", "gate_proj": "inter", "up_proj": "inter", "swiglu": "inter", "mlp_out": "hidden",
          "resid_out": "hidden"}

MODEL = {"decoder": "model", "embed": "model.embed_tokens", "layers": "model.layers", "final_norm": "model.norm",
         "lm_head": "lm_head"}

HF = StackLayout(
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

VLLM = StackLayout(
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
)

FUSED = (Fused("qkv_proj", ("q_proj", "k_proj", "v_proj"), ("q", "kv", "kv")),
         Fused("gate_up_proj", ("gate_proj", "up_proj")))

_ATTN = ("num_attention_heads", "head_dim", "hidden_size")
_KV = ("num_key_value_heads", "head_dim", "hidden_size")
_MLP = ("intermediate_size", "hidden_size")
CHECKPOINT = {
    "input_layernorm.weight": ("hidden_size",),
    "self_attn.q_proj.weight": _ATTN, "self_attn.q_proj.bias": _ATTN,
    "self_attn.k_proj.weight": _KV, "self_attn.k_proj.bias": _KV,
    "self_attn.v_proj.weight": _KV, "self_attn.v_proj.bias": _KV,
    "self_attn.o_proj.weight": _ATTN,
    "post_attention_layernorm.weight": ("hidden_size",),
    "mlp.gate_proj.weight": _MLP, "mlp.up_proj.weight": _MLP, "mlp.down_proj.weight": _MLP,
}
MODEL_TENSORS = {"model.embed_tokens.weight": ("vocab_size", "hidden_size"), "model.norm.weight": ("hidden_size",),
                 "lm_head.weight": ("vocab_size", "hidden_size")}

# vLLM's QKVParallelLinear and MergedColumnParallelLinear shard by heads and columns; o_proj and down_proj are
# RowParallelLinear with reduce_results (model_executor/models/qwen2.py)
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "q_rope", "k_rope", "attn_core", "gate_proj", "up_proj",
                             "swiglu"})

QWEN2 = Family(model_type="qwen2", architecture="Qwen2ForCausalLM", layer_taps=LAYER_TAPS, widths=WIDTHS, hf=HF,
               vllm=VLLM, fused=FUSED, checkpoint=CHECKPOINT, model_tensors=MODEL_TENSORS,
               column_parallel=COLUMN_PARALLEL)
