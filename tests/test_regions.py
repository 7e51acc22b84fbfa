"""Each aligned region, patched on both real stacks (tiny Qwen3: transformers and vLLM's in-process model),
maps bitwise-equal inputs to bitwise-equal outputs; unpatching restores the shipped behaviour bitwise."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from divergence_probe import align
from divergence_probe.regions import aligned, rmsnorm
from divergence_probe.stacks.hooks import HookSet

SHAPES = [1, 7, 64]  # tokens
DTYPES = [torch.bfloat16, torch.float16]


def rand(*shape, dtype, seed):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


@pytest.fixture(scope="module")
def models(vllm_probe):
    return vllm_probe, vllm_probe.train.model, vllm_probe.infer.model


def hf_rope(hf, q, k, positions):
    """transformers' own rope call path: rotary module -> modeling apply_rotary_pos_emb. q, k: [1, H, T, d]."""
    modeling = sys.modules[type(hf.model.layers[0].self_attn).__module__]
    cos, sin = hf.model.rotary_emb(q, positions[None])
    return modeling.apply_rotary_pos_emb(q, k, cos, sin)


def vllm_rope(vm, q, k, positions):
    """vLLM's own call: RotaryEmbedding(positions, q [T, H*d], k [T, Hkv*d]) (in place on CPU, so pass copies)."""
    T, H, d = q.shape[2], q.shape[1], q.shape[3]
    qf = q[0].transpose(0, 1).reshape(T, -1).clone()
    kf = k[0].transpose(0, 1).reshape(T, -1).clone()
    q_out, k_out = vm.model.layers[0].self_attn.rotary_emb(positions, qf, kf)
    return q_out.view(T, H, d).transpose(0, 1)[None], k_out.view(T, -1, d).transpose(0, 1)[None]


@pytest.mark.parametrize("tokens", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_aligned_is_bitwise_equal_across_stacks(models, tokens, dtype):
    probe, hf, vm = models
    d = hf.config.head_dim
    q = rand(1, hf.config.num_attention_heads, tokens, d, dtype=dtype, seed=tokens)
    k = rand(1, hf.config.num_key_value_heads, tokens, d, dtype=dtype, seed=tokens + 1)
    positions = torch.arange(100, 100 + tokens)
    with torch.inference_mode():
        shipped_hf, shipped_vllm = hf_rope(hf, q, k, positions), vllm_rope(vm, q, k, positions)
        with aligned([probe.train, probe.infer], ["rope"]):
            a_hf, a_vllm = hf_rope(hf, q, k, positions), vllm_rope(vm, q, k, positions)
        after_hf, after_vllm = hf_rope(hf, q, k, positions), vllm_rope(vm, q, k, positions)
    for x, y in zip(a_hf, a_vllm):
        assert x.dtype == dtype and torch.equal(x, y)
    for before, after in zip(shipped_hf + shipped_vllm, after_hf + after_vllm):
        assert torch.equal(before, after)  # unpatching restores the shipped numerics
    if dtype == torch.bfloat16:  # as shipped the stacks disagree (3 R vs one conversion): the patch matters
        assert not all(torch.equal(x, y) for x, y in zip(shipped_hf, shipped_vllm))


@pytest.fixture(scope="module")
def hf_by_dtype(models):
    """The transformers model in each tested dtype (the fp16 one is a cast copy of the bf16 checkpoint)."""
    _, hf, _ = models
    return {torch.bfloat16: hf, torch.float16: copy.deepcopy(hf).to(torch.float16)}


@pytest.mark.parametrize("tokens", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_aligned_is_bitwise_equal_across_stacks(models, hf_by_dtype, tokens, dtype):
    """transformers' patched MLP on real gate/up projections vs vLLM's patched SiluAndMul on the same values."""
    probe, _, vm = models
    hf = hf_by_dtype[dtype]
    mlp, act_vllm = hf.model.layers[0].mlp, vm.model.layers[0].mlp.act_fn
    x = rand(1, tokens, hf.config.hidden_size, dtype=dtype, seed=tokens)
    seen = {}
    with torch.inference_mode(), HookSet() as hooks:
        hooks.after(mlp.gate_proj, lambda m, a, k, o: seen.update(gate=o))
        hooks.after(mlp.up_proj, lambda m, a, k, o: seen.update(up=o))
        hooks.before(mlp.down_proj, lambda m, a, k: seen.update(down_in=a[0]))
        gate_up_probe = torch.cat([rand(tokens, 8, dtype=dtype, seed=1)] * 2, -1)
        shipped = act_vllm(gate_up_probe)
        with align.apply(hf, "swiglu"), aligned([probe.infer], ["swiglu"]):
            mlp(x)
            vllm_out = act_vllm(torch.cat([seen["gate"], seen["up"]], -1))
        assert torch.equal(act_vllm(gate_up_probe), shipped)
    assert seen["down_in"].dtype == dtype and torch.equal(seen["down_in"], vllm_out)


@pytest.mark.parametrize("tokens", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_aligned_is_bitwise_equal_across_stacks(models, tokens, dtype):
    probe, hf, vm = models
    hf_norm, vllm_norm = hf.model.layers[1].post_attention_layernorm, vm.model.layers[1].post_attention_layernorm
    hf_qn, vllm_qn = hf.model.layers[0].self_attn.q_norm, vm.model.layers[0].self_attn.q_norm
    x = rand(tokens, hf.config.hidden_size, dtype=dtype, seed=tokens)
    res = rand(tokens, hf.config.hidden_size, dtype=dtype, seed=tokens + 7)
    heads = rand(tokens, hf.config.num_attention_heads, hf.config.head_dim, dtype=dtype, seed=3)
    with torch.inference_mode():
        shipped = vllm_norm(x.clone(), res.clone())
        shipped_hf = hf_norm(x)
        with aligned([probe.train, probe.infer], ["rmsnorm"]):
            v_out, v_res = vllm_norm(x.clone(), res.clone())
            stream = rmsnorm.residual_add(x, res)  # what the aligned decoder layer hands the next norm
            h_out = hf_norm(stream)
            assert torch.equal(stream, v_res) and torch.equal(h_out, v_out) and h_out.dtype == dtype
            assert torch.equal(hf_norm(x), vllm_norm(x.clone()))  # no residual: first layer's input norm
            assert torch.equal(hf_qn(heads), vllm_qn(heads.clone()))  # Qwen3's per-head norms
        after = vllm_norm(x.clone(), res.clone())
        assert all(torch.equal(a, b) for a, b in zip(shipped, after))
        assert torch.equal(hf_norm(x), shipped_hf)


def test_patches_leave_no_trace(models):
    probe, hf, vm = models
    modules = list(hf.modules()) + list(vm.modules())
    before = [dict(vars(m)) for m in modules]
    modeling = sys.modules[type(hf.model.layers[0].self_attn).__module__]
    apply_before = modeling.apply_rotary_pos_emb
    with aligned([probe.train, probe.infer], ["rope", "swiglu", "rmsnorm"]):
        assert modeling.apply_rotary_pos_emb is not apply_before
    assert modeling.apply_rotary_pos_emb is apply_before
    for m, b in zip(modules, before):
        assert vars(m).keys() == b.keys() and all(vars(m)[k] is b[k] for k in b)
    weights = {n: p.data_ptr() for n, p in hf.named_parameters()}
    with aligned([probe.train], ["rmsnorm"]):
        assert weights == {n: p.data_ptr() for n, p in hf.named_parameters()}


def test_side_train_leaves_vllm_untouched(vllm_probe, prompts_file):
    vm = vllm_probe.infer.model
    methods = {id(m): m._forward_method for m in vm.modules() if hasattr(m, "_forward_method")}
    shipped = vllm_probe.compare(prompts=prompts_file, taps="none")
    from divergence_probe.ablate import stacks_for

    with aligned(stacks_for(vllm_probe, "train"), ["rope", "swiglu", "rmsnorm"]):
        assert methods == {id(m): m._forward_method for m in vm.modules() if hasattr(m, "_forward_method")}
    run = vllm_probe.compare(prompts=prompts_file, taps="none", align="rope,swiglu,rmsnorm", side="train")
    assert run.tokens_table["logprob_infer"].equals(shipped.tokens_table["logprob_infer"])
    assert not run.tokens_table["logprob_train"].equals(shipped.tokens_table["logprob_train"])
