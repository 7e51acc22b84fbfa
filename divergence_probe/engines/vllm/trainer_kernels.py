"""The engine's own kernels in the trainer's forward (`--train-kernels vllm`): the "bitwise" recipe of running one
set of kernels on both sides.

The trainer's RMSNorm modules, its residual add into the next norm (vLLM's fused add+norm), its SwiGLU product and its
rotary embedding call vLLM's layer objects, built here with every custom op enabled, so each op dispatches as it does
inside an eager engine on this platform (`torch.ops._C` kernels where the platform has them, vLLM's native code where
it does not). What stays transformers' own is the GEMMs (vLLM fuses QKV and gate/up) and attention.

transformers adds the residual inline in its decoder layer, so the layer's forward is the rmsnorm region's explicit
dataflow with an add that hands the next norm both summands (`_Summands`), and that norm runs vLLM's fused add+norm on
them. vLLM's fused ops write in place, so they get copies. These ops carry no gradients: rl refuses this set.
"""

from __future__ import annotations

import torch

from ...errors import ProbeError
from ...models import find
from ..hf.patches.rmsnorm import hf_layer_forward
from ..layouts import decoder_layers, layer_name, layout_of, part
from ..hf.kernels.base import KernelSet, modeling_modules
from ..hooks import Replacement
from ..needs import Needs

_SUMMANDS = "_divergence_probe_vllm_summands"  # on a residual-stream tensor: (x, residual) it is the rounded sum of


def _engine_ops():
    """vLLM's layer classes, imported when the set is planned (never at the CLI's --help)."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))  # the kernels, as an eager engine
    return config, set_current_vllm_config, RMSNorm, SiluAndMul, get_rope


def _summed_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The residual stream as vLLM's fused add stores it, R(x + residual), carrying both summands for the next norm."""
    out = (x.float() + residual.float()).to(x.dtype)
    setattr(out, _SUMMANDS, (x, residual))
    return out


def _norm_forward(engine_norm):
    def forward(hidden_states):
        summands = getattr(hidden_states, _SUMMANDS, None)
        if summands is None:
            return engine_norm(hidden_states)
        x, residual = summands
        return engine_norm(x.clone(), residual.clone())[0]  # in place on CUDA: never on the trainer's tensors

    return forward


def _mlp_forward(layer, hf, silu_and_mul):
    gate, up, down = (hf.layer[role] for role in ("gate_proj", "up_proj", "down_proj"))

    def forward(x):  # looked up per call, as the layer's own forward does
        return find(layer, down)(silu_and_mul(torch.cat([find(layer, gate)(x), find(layer, up)(x)], dim=-1)))

    return forward


def _rope_forward(rotary, engine_rope):
    """The rotary module's output marked with the positions it was asked for and this model's vLLM rotary kernel,
    which reads its own cos/sin cache."""

    def forward(x, position_ids):
        cos, sin = rotary.__class__.forward(rotary, x, position_ids)
        cos.positions, cos.engine_rope = position_ids, engine_rope
        return cos, sin

    return forward


# One apply function per modeling module, shared by every trainer on this kernel set (two trainers live at once, the
# kernel noise floor's second one beside the run's): each call finds its model's kernel on the cos it is given.
_APPLY: dict = {}


def _apply_rope(modeling):
    """apply_rotary_pos_emb(q, k, cos, sin) on [B, heads, T, d] through vLLM's rotary kernel ([tokens, heads*d])."""
    if modeling in _APPLY:
        return _APPLY[modeling]
    shipped = modeling.apply_rotary_pos_emb

    def apply(q, k, cos, sin, *args, **kwargs):
        engine_rope = getattr(cos, "engine_rope", None)
        if engine_rope is None:  # another model of the class, not patched: its own code
            return shipped(q, k, cos, sin, *args, **kwargs)
        positions = cos.positions
        b, hq, t, d = q.shape
        hk = k.shape[1]
        flat_q = q.transpose(1, 2).reshape(b * t, hq * d).clone()
        flat_k = k.transpose(1, 2).reshape(b * t, hk * d).clone()
        rq, rk = engine_rope(positions.reshape(-1), flat_q, flat_k)
        return (rq.view(b, t, hq, d).transpose(1, 2), rk.view(b, t, hk, d).transpose(1, 2))

    if shipped.__module__ == modeling.__name__:  # transformers' own function (not another set's, live elsewhere)
        _APPLY[modeling] = apply
    return apply


def plan(model: torch.nn.Module) -> list[Replacement]:
    config, current, RMSNorm, SiluAndMul, get_rope = _engine_ops()
    hf = layout_of(model, "hf")
    cfg = model.config
    dtype = next(model.parameters()).dtype
    found: list[Replacement] = []
    with current(config):
        for name, norm in model.named_modules():
            if type(norm).__name__.endswith("RMSNorm"):
                engine_norm = RMSNorm(norm.weight.shape[0], norm.variance_epsilon, dtype=norm.weight.dtype)
                engine_norm.weight = norm.weight  # the trainer's own parameter
                found.append(Replacement(norm, "forward", _norm_forward(engine_norm)))
        silu_and_mul = SiluAndMul()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        engine_rope = get_rope(head_dim, max_position=cfg.max_position_embeddings, is_neox_style=True,
                               rope_parameters=cfg.rope_parameters, dtype=dtype)
    if cfg.hidden_act != "silu":
        raise ProbeError(f"--train-kernels vllm runs vLLM's SiLU-and-mul, and this model's hidden_act is "
                         f"{cfg.hidden_act!r}; use --train-kernels torch")
    dense = "swiglu" in hf.regions  # a mixture of experts keeps transformers' experts
    for i, layer in enumerate(decoder_layers(model, "hf")):
        found.append(Replacement(part(layer, "", hf, hf.regions["rmsnorm"]), "forward",
                                 hf_layer_forward(layer, hf, add=_summed_add)))
        if dense:
            mlp = part(layer, layer_name(hf, i), hf, hf.regions["swiglu"])
            found.append(Replacement(mlp, "forward", _mlp_forward(layer, hf, silu_and_mul)))
    for rotary in (m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")):
        found.append(Replacement(rotary, "forward", _rope_forward(rotary, engine_rope)))
    for modeling in modeling_modules(model):
        found.append(Replacement(modeling, "apply_rotary_pos_emb", _apply_rope(modeling), shared=True,
                                 pooled=True))
    return found


VLLM = KernelSet(
    name="vllm",
    summary="vLLM's own RMSNorm (and fused add+norm), SiLU-and-mul and rotary kernels in the trainer's forward",
    plan=plan,
    overlaps=("rmsnorm", "residual", "swiglu", "rope"),
    backward=False,
    needs=Needs(package="vllm", install="install vLLM beside the trainer, or use --train-kernels torch"),
)
