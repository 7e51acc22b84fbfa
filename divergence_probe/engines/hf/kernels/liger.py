"""Liger-Kernel's fused RMSNorm, RoPE and SwiGLU in the trainer, as verl, OpenRLHF and TRL enable it for Qwen2, Qwen3
and Qwen3-MoE (`apply_liger_kernel_to_qwen2(model=...)` and its siblings, with the loss kernels off: the tool scores
logits, not a loss).

Liger's own apply functions assign module attributes and bind forwards with plain setattr, which nothing undoes; the
same changes are planned here as replacements, so the trainer's HookSet applies them after checking for conflicts
and undoes them when the set is swapped or the stack closes: the modeling module's `apply_rotary_pos_emb`, and on
every RMSNorm module and dense MLP Liger's forward with the attributes Liger's forward reads. A mixture of experts
keeps transformers' experts (Liger's MoE SwiGLU replaces the experts' class, not a loaded instance). Triton kernels:
a CUDA device only.
"""

from __future__ import annotations

import types

from ...layouts import decoder_layers, layer_name, layout_of, part
from ...hooks import Replacement
from ...needs import Needs
from .base import KernelSet, modeling_modules


def plan(model) -> list[Replacement]:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    found: list[Replacement] = []
    for norm in (m for m in model.modules() if type(m).__name__.endswith("RMSNorm")):
        # what liger's _patch_rms_norm_module sets (Qwen: offset 0, Llama-style casting, in place)
        for name, value in (("offset", 0.0), ("casting_mode", "llama"), ("in_place", True), ("row_mode", None),
                            ("impl", None), ("mode", None), ("forward", types.MethodType(LigerRMSNorm.forward, norm))):
            found.append(Replacement(norm, name, value))
    hf = layout_of(model, "hf")
    if "swiglu" in hf.regions:
        for i, layer in enumerate(decoder_layers(model, "hf")):
            mlp = part(layer, layer_name(hf, i), hf, hf.regions["swiglu"])
            found.append(Replacement(mlp, "forward", types.MethodType(LigerSwiGLUMLP.forward, mlp)))
    for modeling in modeling_modules(model):
        found.append(Replacement(modeling, "apply_rotary_pos_emb", liger_rotary_pos_emb, shared=True, pooled=True))
    return found


LIGER = KernelSet(
    name="liger",
    summary="Liger-Kernel's fused RMSNorm, RoPE and SwiGLU (Triton), as RL trainers enable it",
    plan=plan,
    overlaps=("rmsnorm", "residual", "swiglu", "rope"),
    needs=Needs(devices=("cuda",), package="liger_kernel",
                install="`pip install liger-kernel` on the CUDA machine (a pure-Python wheel; it needs triton), or use "
                        "--train-kernels torch"),
)
