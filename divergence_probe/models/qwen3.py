"""Qwen3 (dense): Qwen2's layer without the q/k/v biases, plus a per-head RMSNorm of q and of k before RoPE
(`q_norm`, `k_norm`; transformers `models/qwen3/modeling_qwen3.py`, vLLM `model_executor/models/qwen3.py`, which
builds on its qwen2.py the same way)."""

from __future__ import annotations

from dataclasses import replace

from .qwen2 import CHECKPOINT, QWEN2

LAYER_TAPS = QWEN2.layer_taps[:4] + ("q_norm", "k_norm") + QWEN2.layer_taps[4:]  # after v_proj, before q_rope
CHECKPOINT = {**{k: v for k, v in CHECKPOINT.items() if not k.endswith(".bias")},
              "self_attn.q_norm.weight": ("head_dim",), "self_attn.k_norm.weight": ("head_dim",)}

QWEN3 = replace(QWEN2, model_type="qwen3", architecture="Qwen3ForCausalLM", layer_taps=LAYER_TAPS,
                checkpoint=CHECKPOINT, required_config=("head_dim",),  # Qwen2 derives head_dim from the hidden size
                column_parallel=QWEN2.column_parallel | {"q_norm", "k_norm"})  # per head, on the rank's heads
