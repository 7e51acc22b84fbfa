"""Qwen3 (dense): Qwen2's layer without the q/k/v biases, plus a per-head RMSNorm of q and of k before RoPE
(`q_norm`, `k_norm`; transformers `models/qwen3/modeling_qwen3.py`, vLLM `model_executor/models/qwen3.py`, which
builds on its qwen2.py the same way)."""

from __future__ import annotations

from dataclasses import replace

from .base import Seam
from .qwen2 import CHECKPOINT, QWEN2


def _after(seams: tuple[Seam, ...], module: str, *added: Seam) -> tuple[Seam, ...]:
    """`seams` with `added` inserted after the last seam at `module` (dataflow order)."""
    at = max(i for i, s in enumerate(seams) if s.module == module) + 1
    return seams[:at] + added + seams[at:]


_QK_NORM = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}

HF = replace(QWEN2.hf, layer={**QWEN2.hf.layer, **_QK_NORM},
             seams=_after(QWEN2.hf.seams, "v_proj", Seam(("q_norm",), "q_norm", "heads"),
                          Seam(("k_norm",), "k_norm", "heads")))
VLLM = replace(QWEN2.vllm, layer={**QWEN2.vllm.layer, **_QK_NORM},
               seams=_after(QWEN2.vllm.seams, "qkv_proj", Seam(("q_norm",), "q_norm"), Seam(("k_norm",), "k_norm")))

LAYER_TAPS = QWEN2.layer_taps[:4] + ("q_norm", "k_norm") + QWEN2.layer_taps[4:]  # after v_proj, before q_rope
CHECKPOINT = {**{k: v for k, v in CHECKPOINT.items() if not k.endswith(".bias")},
              "self_attn.q_norm.weight": ("head_dim",), "self_attn.k_norm.weight": ("head_dim",)}

QWEN3 = replace(QWEN2, model_type="qwen3", architecture="Qwen3ForCausalLM", layer_taps=LAYER_TAPS, hf=HF, vllm=VLLM,
                checkpoint=CHECKPOINT, required_config=("head_dim",),  # Qwen2 derives head_dim from the hidden size
                column_parallel=QWEN2.column_parallel | {"q_norm", "k_norm"})  # per head, on the rank's heads
