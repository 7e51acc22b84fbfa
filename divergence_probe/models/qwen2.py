"""Qwen2 (Qwen2.5): pre-norm decoder layer, GQA attention with q/k/v biases, SwiGLU MLP, residual RMSNorm.

transformers 5.x `models/qwen2/modeling_qwen2.py` and vLLM `model_executor/models/qwen2.py` (docs/numerics.md
has the map of both); where each keeps the modules and reads the taps is its layout (engines/hf/layouts.py,
engines/vllm/layouts.py).
"""

from __future__ import annotations

from .base import Family

LAYER_TAPS = ("input_norm", "q_proj", "k_proj", "v_proj", "q_rope", "k_rope", "attn_core", "attn_out", "resid_mid",
              "post_norm", "gate_proj", "up_proj", "swiglu", "mlp_out", "resid_out")
WIDTHS = {"input_norm": "hidden", "q_proj": "q", "k_proj": "kv", "v_proj": "kv", "q_norm": "q", "k_norm": "kv",
          "q_rope": "q", "k_rope": "kv", "attn_core": "q", "attn_out": "hidden", "resid_mid": "hidden",
          "post_norm": "hidden", "gate_proj": "inter", "up_proj": "inter", "swiglu": "inter", "mlp_out": "hidden",
          "resid_out": "hidden"}

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

# q/k/v and gate/up are column-parallel GEMMs, sharded by heads and columns; o_proj and down_proj are row-parallel with
# an all-reduce (vLLM's QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear in model_executor/models/qwen2.py)
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "q_rope", "k_rope", "attn_core", "gate_proj", "up_proj",
                             "swiglu"})

QWEN2 = Family(model_type="qwen2", architecture="Qwen2ForCausalLM", layer_taps=LAYER_TAPS, widths=WIDTHS,
               checkpoint=CHECKPOINT, model_tensors=MODEL_TENSORS, column_parallel=COLUMN_PARALLEL)
