"""Aligned regions: each computes the reference's formula rounded once (float64 references, through the patched
transformers decoder layers), maps bitwise-equal inputs to bitwise-equal outputs on both real stacks, and is
undone bitwise; and the patch contract (find every target first, real counts, overlaps raise)."""

from __future__ import annotations

import copy
import math
import sys
from collections import defaultdict

import pytest
import torch

from divergence_probe import align
from divergence_probe.errors import StackError
from divergence_probe.regions import ALL_REGIONS, REGIONS, Region
from divergence_probe.engines.hf.patches import PATCHES as HF_PATCHES
from divergence_probe.engines.hf.patches import rmsnorm as hf_rmsnorm
from divergence_probe.engines.patching import aligned, decoder_layers, patch, plan
from divergence_probe.engines.hooks import HookSet, PatchConflict, Replacement, arg, first_tensor

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
            stream = hf_rmsnorm.residual_add(x, res)  # what the aligned decoder layer hands the next norm
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
    from divergence_probe.runs.ablate import stacks_for

    with aligned(stacks_for(vllm_probe, "train"), ["rope", "swiglu", "rmsnorm"]):
        assert methods == {id(m): m._forward_method for m in vm.modules() if hasattr(m, "_forward_method")}
    run = vllm_probe.compare(prompts=prompts_file, taps="none", align="rope,swiglu,rmsnorm", side="train")
    assert run.tokens_table["logprob_infer"].equals(shipped.tokens_table["logprob_infer"])
    assert not run.tokens_table["logprob_train"].equals(shipped.tokens_table["logprob_train"])


# -----------------------------------------------------------------------------
# The aligned formula (docs/reference/ablation.md, "Region alignment") against an independent float64 reference,
# rounded once.
#
# Why "within the FP32 error bound" and not "equal": each aligned region evaluates the formula in FP32 and
# rounds once; FP32 differs from the exact value by a few FP32 ULPs (2^-24 relative each). Rounding the FP32
# value and rounding the exact value give the same BF16 number unless the exact value lies within that
# distance of a rounding midpoint, where they land on neighbours: 1 ULP, never 0 by construction. The check
# below is the sharp form of "at most 1 ULP": out must be R(y) for some y within eps of the exact value, i.e.
# R(exact - eps) <= out <= R(exact + eps); where eps is under half an ULP this allows only R(exact) and, at
# a near-tie, its neighbour. The one place eps can exceed half an ULP is RoPE's x1*c - x2*s cancelling to
# far below its terms; there only the bracket is asserted (an FP32 evaluation cannot promise more).
# -----------------------------------------------------------------------------

U = 2.0 ** -24  # FP32 unit roundoff


def round_once(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 -> dtype with ONE round-to-nearest-even. torch's cast goes float64 -> FP32 -> dtype (two
    roundings, one ULP off at near-ties), so take the nearest of the cast and its two neighbours."""
    best = x.to(dtype)
    inf = torch.tensor(math.inf, dtype=dtype)
    best_dist = (best.double() - x).abs()
    for other in (torch.nextafter(best, -inf), torch.nextafter(best, inf)):
        dist = (other.double() - x).abs()
        better = (dist < best_dist) | ((dist == best_dist) & ((best.view(torch.int16) & 1) == 1))  # tie: even
        best, best_dist = torch.where(better, other, best), torch.where(better, dist, best_dist)
    return best


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable 16-bit floats apart (sign-magnitude bits mapped onto a line)."""
    def line(t):
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (line(a) - line(b)).abs()


def rounding_errors(out: torch.Tensor, exact: torch.Tensor, eps: torch.Tensor) -> tuple[int, int]:
    """(elements that are not R(y) for any y within eps of exact, largest ULP distance to R(exact) where eps is
    under half an ULP). out = R(y) for such a y iff out's rounding interval meets [exact - eps, exact + eps]."""
    o, inf = out.double(), torch.tensor(math.inf, dtype=out.dtype)
    half_up = (torch.nextafter(out, inf).double() - o) / 2
    half_down = (o - torch.nextafter(out, -inf).double()) / 2
    outside = (exact - eps > o + half_up) | (exact + eps < o - half_down)
    mild = eps < torch.minimum(half_up, half_down)
    r = round_once(exact[mild], out.dtype)
    return int(outside.sum()), int(ulp_distance(out[mild], r).max()) if mild.any() else 0


def rms_exact(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """s * rsqrt(mean(s^2) + eps) * w, all float64."""
    s = s.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rms_eps(exact: torch.Tensor, width: int) -> torch.Tensor:
    """FP32 error bound of the aligned norm: the mean of squares over `width` terms (width+2 roundings), halved
    by rsqrt, plus rsqrt, the FP32 residual sum and two products; (width + 8) U bounds it."""
    return (width + 8) * U * exact.abs()


def swiglu_exact(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.double()
    return g / (1 + torch.exp(-g)) * up.double()


SWIGLU_EPS = 16 * U  # silu in FP32 (exp within 1 ULP, an add, a division) and the product: ~5 roundings, 16 U bounds


def rope_exact(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """x [T, heads, d]; returns (exact rotation, |terms| for the error bound). The reference's formula takes the
    angle position * inv_freq in FP32: the product is exact in float64 and rounded to FP32 once; cos, sin and
    the rotation are float64."""
    angle = (positions.double()[:, None] * inv_freq.double()).float().double()[:, None, :]  # [T, 1, d/2]
    c, s = angle.cos(), angle.sin()
    x1, x2 = x.double().chunk(2, dim=-1)
    exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    terms = torch.cat(((x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()), -1)
    return exact, terms


ROPE_EPS = 8 * U  # per unit of |terms|: two products and a sum in FP32, FP32 cos/sin within 1 ULP (2 U) each


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def hf_tiny(qwen2_tiny, qwen3_tiny):
    return {"qwen2": load_hf(qwen2_tiny), "qwen3": load_hf(qwen3_tiny)}


def run_capturing(model, ids: torch.Tensor, positions: torch.Tensor) -> dict:
    """One forward of the (patched or shipped) transformers model; what each region saw and produced, per layer
    ([T, ...] tensors). q/k after RoPE are read where transformers hands them to the attention function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen: dict = defaultdict(dict)
    impl = model.config._attn_implementation
    inner = ALL_ATTENTION_FUNCTIONS[impl]

    def attention(module, query, key, value, attention_mask, **kwargs):  # [1, heads, T, d]
        seen[module.layer_idx].update(q_rope=query[0].transpose(0, 1), k_rope=key[0].transpose(0, 1))
        return inner(module, query, key, value, attention_mask, **kwargs)

    def out(where, name):
        return lambda m, a, k, o: seen[where].__setitem__(name, first_tensor(o)[0])

    def inp(where, name, arg_name):
        return lambda m, a, k: seen[where].__setitem__(name, arg(a, k, 0, arg_name)[0])

    inner_model = model.model
    with torch.inference_mode(), HookSet() as hooks:
        hooks.replace_item(ALL_ATTENTION_FUNCTIONS._local_mapping, impl, attention, owner="the region test")
        hooks.after(inner_model.embed_tokens, out("model", "embed"))
        hooks.after(inner_model.norm, out("model", "final_norm"))
        for i, layer in enumerate(inner_model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            hooks.before(layer, inp(i, "x_in", "hidden_states"))
            hooks.after(layer, out(i, "layer_out"))
            hooks.after(layer.input_layernorm, out(i, "input_norm"))
            hooks.before(layer.post_attention_layernorm, inp(i, "stream", "hidden_states"))
            hooks.after(layer.post_attention_layernorm, out(i, "post_norm"))
            for name in ("q_proj", "k_proj", "o_proj"):
                hooks.after(getattr(attn, name), out(i, name))
            for name in ("q_norm", "k_norm"):
                if hasattr(attn, name):
                    hooks.after(getattr(attn, name), out(i, name))
            hooks.after(mlp.gate_proj, out(i, "gate"))
            hooks.after(mlp.up_proj, out(i, "up"))
            hooks.before(mlp.down_proj, inp(i, "down_in", "input"))
            hooks.after(mlp.down_proj, out(i, "mlp_out"))
        model(input_ids=ids, position_ids=positions[None], use_cache=False)
    return seen


def region_errors(model, seen: dict, positions: torch.Tensor) -> dict[str, tuple[int, int]]:
    """region -> (elements not R(y) for a y within the FP32 bound of the exact formula, worst ULP distance
    to R(exact) where the bound is under half an ULP), over every layer of one captured forward."""
    config, layers = model.config, model.model.layers
    n, d = config.num_hidden_layers, head_dim(config)
    found = defaultdict(list)
    inv_freq = model.model.rotary_emb.inv_freq  # transformers' own FP32 frequencies (the patch leaves buffers be)
    for i in range(n):
        t, layer = seen[i], layers[i]
        # rmsnorm: the norms see the FP32 sum of the BF16 residual stream and the sublayer output
        if i == 0:
            s_in = seen["model"]["embed"].double()
        else:  # the previous layer's output before its rounding: its mlp output plus its residual stream
            s_in = seen[i - 1]["mlp_out"].double() + seen[i - 1]["stream"].double()
        s_mid = t["o_proj"].double() + t["x_in"].double()
        for got, s, norm in ((t["input_norm"], s_in, layer.input_layernorm),
                             (t["post_norm"], s_mid, layer.post_attention_layernorm)):
            exact = rms_exact(s, norm.weight, norm.variance_epsilon)
            found["rmsnorm"].append(rounding_errors(got, exact, rms_eps(exact, s.shape[-1])))
        for got, exact in ((t["stream"], s_mid), (t["layer_out"], t["mlp_out"].double() + t["stream"].double())):
            found["rmsnorm"].append(rounding_errors(got, exact, U * exact.abs()))  # one FP32 add, then R
        pre = {}
        for name, heads in (("q", config.num_attention_heads), ("k", config.num_key_value_heads)):
            proj = t[f"{name}_proj"].view(-1, heads, d)
            if f"{name}_norm" in t:  # Qwen3's per-head norms belong to the rmsnorm region
                norm = getattr(layer.self_attn, f"{name}_norm")
                exact = rms_exact(proj, norm.weight, norm.variance_epsilon)
                found["rmsnorm"].append(rounding_errors(t[f"{name}_norm"], exact, rms_eps(exact, d)))
                pre[name] = t[f"{name}_norm"]
            else:
                pre[name] = proj
            exact, terms = rope_exact(pre[name], positions, inv_freq)
            found["rope"].append(rounding_errors(t[f"{name}_rope"], exact, ROPE_EPS * terms))
        exact = swiglu_exact(t["gate"], t["up"])
        found["swiglu"].append(rounding_errors(t["down_in"], exact, SWIGLU_EPS * exact.abs()))
    s_final = seen[n - 1]["mlp_out"].double() + seen[n - 1]["stream"].double()
    exact = rms_exact(s_final, model.model.norm.weight, model.model.norm.variance_epsilon)
    found["rmsnorm"].append(rounding_errors(seen["model"]["final_norm"], exact, rms_eps(exact, s_final.shape[-1])))
    return {r: (sum(o for o, _ in v), max(u for _, u in v)) for r, v in found.items()}


def test_transformers_rope_frequencies_are_the_formula(hf_tiny):
    """The reference takes transformers' FP32 inv_freq; it is 1/base^(2i/d) within 2 FP32 ULPs."""
    for model in hf_tiny.values():
        config, inv = model.config, model.model.rotary_emb.inv_freq
        d = head_dim(config)
        exact = 1 / config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        assert inv.dtype == torch.float32 and ((inv.double() - exact).abs() <= 4 * U * exact).all()


@pytest.fixture
def one_thread():
    """The float64 references are elementwise work on ~10^4 elements, just above torch's parallel grain: on a
    shared CPU the OpenMP handoffs cost far more than the work, so these tests run single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("tokens, offset", [(64, 1900), (5, 3)])  # long positions (large angles); a short prompt
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_patched_decoder_layers_compute_the_formula(hf_tiny, one_thread, arch, tokens, offset):
    """The patched transformers decoder layers (patched through align.apply, driven by the model's own
    forward) produce each aligned region's formula rounded once, whether aligned alone or all together; the
    shipped layers do not (so the check can tell them apart)."""
    model = hf_tiny[arch]
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    positions = torch.arange(offset, offset + tokens)
    for regions in [ALL_REGIONS, *((r,) for r in ALL_REGIONS)]:
        with align.apply(model, regions):
            errors = region_errors(model, run_capturing(model, ids, positions), positions)
        for region in regions:
            outside, worst_ulp = errors[region]
            assert outside == 0 and worst_ulp <= 1, (regions, region, errors[region])
    shipped = region_errors(model, run_capturing(model, ids, positions), positions)
    assert all(outside > 0 for outside, _ in shipped.values()), shipped


def test_patched_vllm_modules_equal_patched_transformers(vllm_probe, hf_tiny, one_thread):
    """The loaded engine's patched modules (rotary_emb, SiluAndMul, RMSNorm incl. the fused residual add, the
    final norm and q_norm/k_norm), fed what the patched transformers layers saw, give their outputs bitwise."""
    hf, vm = hf_tiny["qwen3"], vllm_probe.infer.model  # the same checkpoint
    config, d = hf.config, head_dim(hf.config)
    ids = torch.randint(0, config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(1000, 1048)
    with align.apply(hf, ALL_REGIONS):
        seen = run_capturing(hf, ids, positions)
    n = config.num_hidden_layers
    with torch.inference_mode(), aligned([vllm_probe.infer], ALL_REGIONS):
        for i, layer in enumerate(vm.model.layers[:n]):
            t, attn = seen[i], layer.self_attn
            if i == 0:
                assert torch.equal(layer.input_layernorm(seen["model"]["embed"].clone()), t["input_norm"])
            else:
                out, stream = layer.input_layernorm(seen[i - 1]["mlp_out"].clone(), seen[i - 1]["stream"].clone())
                assert torch.equal(out, t["input_norm"]) and torch.equal(stream, t["x_in"])
            q = attn.q_norm(t["q_proj"].view(-1, config.num_attention_heads, d).clone())
            k = attn.k_norm(t["k_proj"].view(-1, config.num_key_value_heads, d).clone())
            assert torch.equal(q, t["q_norm"]) and torch.equal(k, t["k_norm"])
            q_rope, k_rope = attn.rotary_emb(positions, q.reshape(len(positions), -1).clone(),
                                             k.reshape(len(positions), -1).clone())
            assert torch.equal(q_rope.view_as(t["q_rope"]), t["q_rope"])
            assert torch.equal(k_rope.view_as(t["k_rope"]), t["k_rope"])
            out, stream = layer.post_attention_layernorm(t["o_proj"].clone(), t["x_in"].clone())
            assert torch.equal(out, t["post_norm"]) and torch.equal(stream, t["stream"])
            assert torch.equal(layer.mlp.act_fn(torch.cat([t["gate"], t["up"]], -1)), t["down_in"])
        final, _ = vm.model.norm(seen[n - 1]["mlp_out"].clone(), seen[n - 1]["stream"].clone())
        assert torch.equal(final, seen["model"]["final_norm"])


# -----------------------------------------------------------------------------
# The patch contract: every target found before anything changes; real counts; overlaps raise.
# -----------------------------------------------------------------------------


def snapshot(model):
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    return [(m, dict(vars(m))) for m in model.modules()], modeling, modeling.apply_rotary_pos_emb


def assert_unchanged(snap) -> None:
    """No module gained, lost or swapped an attribute (a replaced forward shows here) and the modeling
    module's apply_rotary_pos_emb is the shipped one."""
    modules, modeling, shipped = snap
    assert modeling.apply_rotary_pos_emb is shipped
    for m, before in modules:
        assert vars(m).keys() == before.keys() and all(vars(m)[k] is before[k] for k in before), type(m).__name__


@pytest.fixture
def fresh_qwen3(qwen3_tiny):
    """A transformers model this test may break."""
    return load_hf(qwen3_tiny)


BREAKS = {  # region -> (remove one of its targets, what the error must name)
    "rope": (lambda m: delattr(m.model, "rotary_emb"), "no rotary embedding module"),
    "swiglu": (lambda m: delattr(m.model.layers[2].mlp, "gate_proj"), "no gate_proj in model.model.layers[2].mlp"),
    "rmsnorm": (lambda m: delattr(m.model.layers[3], "post_attention_layernorm"),
                "no post_attention_layernorm in model.model.layers[3]"),
}


@pytest.mark.parametrize("region", ALL_REGIONS)
def test_missing_target_names_stack_version_region_and_changes_nothing(fresh_qwen3, region):
    import transformers

    model = fresh_qwen3
    remove, what = BREAKS[region]
    remove(model)
    snap = snapshot(model)
    with pytest.raises(StackError) as e:
        align.apply(model, ALL_REGIONS)
    message = str(e.value)
    stack = f"the hf stack (transformers {transformers.__version__})"
    assert f"region {region} cannot be aligned on {stack}: {what}" in message
    assert "\n" not in message and "leave" in message  # one line, with the fix
    assert_unchanged(snap)  # the regions found before and after the missing one were not patched either
    with align.apply(model, [r for r in ALL_REGIONS if r != region]):  # and nothing stayed claimed
        pass
    assert_unchanged(snap)


def test_missing_vllm_target_leaves_both_stacks_unpatched(vllm_probe):
    import vllm

    hf, vm = vllm_probe.train.model, vllm_probe.infer.model
    mlp = vm.model.layers[1].mlp
    modules = dict(mlp._modules)
    hf_snap = snapshot(hf)
    methods = {id(m): m._forward_method for m in vm.modules() if hasattr(m, "_forward_method")}
    del mlp._modules["act_fn"]
    try:
        with pytest.raises(StackError) as e, aligned([vllm_probe.train, vllm_probe.infer], ALL_REGIONS):
            pass
    finally:
        mlp._modules.clear()
        mlp._modules.update(modules)  # in its place, so the engine's module order is untouched
    assert f"region swiglu cannot be aligned on the vllm stack (vllm {vllm.__version__}): no act_fn in " \
           "model.model.layers[1].mlp" in str(e.value)
    assert_unchanged(hf_snap)  # transformers was planned first but never patched
    assert methods == {id(m): m._forward_method for m in vm.modules() if hasattr(m, "_forward_method")}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_counts_are_the_targets_found(hf_tiny, arch):
    model = hf_tiny[arch]
    layers = model.model.layers

    def counts(regions=ALL_REGIONS):
        with HookSet() as hooks:
            return patch("hf", model, regions, hooks)

    def expected(n):  # rope: the rotary module and the modeling file's apply_rotary_pos_emb; rmsnorm: each norm
        norms = n * (4 if arch == "qwen3" else 2) + 1  # input/post norms (+ Qwen3's q/k norms) and the final norm
        return {"rope": 2, "swiglu": n, "rmsnorm": norms + n}  # ... and each decoder layer's forward

    assert counts() == expected(model.config.num_hidden_layers)
    try:
        model.model.layers = torch.nn.ModuleList(layers[:1])
        assert counts() == expected(1)
        model.model.layers = torch.nn.ModuleList()
        with pytest.raises(StackError, match="region swiglu cannot be aligned on the hf stack .*: it found nothing"):
            counts(("swiglu",))
    finally:
        model.model.layers = layers


def test_vllm_counts_are_the_targets_found(vllm_probe):
    vm = vllm_probe.infer.model
    n = len(vm.model.layers)
    assert len({id(layer.self_attn.rotary_emb) for layer in vm.model.layers}) == 1  # vLLM shares one instance
    found = {region: len(r) for region, r in plan("vllm", vm, ALL_REGIONS).items()}
    assert found == {"rope": 1, "swiglu": n, "rmsnorm": 4 * n + 1}  # Qwen3: 4 norms a layer and the final norm


TWIN = Region("twin", "a test region that replaces what swiglu replaces")


def _twin_patch(model):
    return [Replacement(layer.mlp, "forward", lambda x: x) for layer in decoder_layers(model, "hf")]


def test_overlapping_patches_raise_and_change_nothing(fresh_qwen3, monkeypatch):
    model = fresh_qwen3
    monkeypatch.setitem(REGIONS, "twin", f"{__name__}:TWIN")
    monkeypatch.setitem(HF_PATCHES, "twin", _twin_patch)
    snap = snapshot(model)
    with pytest.raises(PatchConflict, match=r"Qwen3MLP\.forward is replaced twice \(region swiglu on hf and "
                                            r"region twin on hf\)"):
        align.apply(model, ("rope", "swiglu", "twin"))
    assert_unchanged(snap)
    with align.apply(model, "swiglu"):
        inside = snapshot(model)
        with pytest.raises(PatchConflict, match="region swiglu on hf and region swiglu on hf"):
            align.apply(model, ("rmsnorm", "swiglu"))  # aligned twice: the second finds swiglu taken
        assert_unchanged(inside)  # rmsnorm was not patched either
    assert_unchanged(snap)


def test_attention_swap_conflicts_are_visible(vllm_probe):
    """The transformers capture's attention swap goes through the same conflict check as every replacement."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from divergence_probe.prompts import Prompt

    stack, registry = vllm_probe.train, ALL_ATTENTION_FUNCTIONS._local_mapping
    impl = stack.model.config._attn_implementation
    prompt = Prompt(0, "test", "", tuple(range(1, 9)))
    norm = stack.model.model.layers[0].input_layernorm
    before = dict(registry)

    def sink(*args):
        pass

    with HookSet() as hooks:
        hooks.replace_item(registry, impl, registry.get(impl), owner="an attention region")
        with pytest.raises(PatchConflict, match=rf"ALL_ATTENTION_FUNCTIONS\['{impl}'\] is replaced twice "
                                                r"\(an attention region and the attention taps"):
            stack.score([prompt], frozenset({"input_norm", "q_rope"}), sink)
        assert not norm._forward_hooks  # the capture's other hooks were undone too
    with pytest.raises(PatchConflict, match="the attention taps of a transformers capture and the attention taps"):
        stack.score([prompt], frozenset({"attn_core"}), sink,  # a capture started inside another
                    on_scored=lambda scores: stack.score([prompt], frozenset({"k_rope"}), sink))
    assert dict(registry) == before and not norm._forward_hooks
    assert len(stack.score([prompt], frozenset({"q_rope"}), sink)) == 1  # and captures work again


# -----------------------------------------------------------------------------
# lm_head: the head GEMM in FP32, FP32 logits straight into the softmax (no rounding at all).
#
# The bound: an FP32 dot product of K terms, each product exact (a BF16 x BF16 product fits in FP32's 24 bits),
# summed in any order, is within gamma_K * sum|x_i w_i| of the exact sum, gamma_K = K u / (1 - K u) (Higham,
# Accuracy and Stability of Numerical Algorithms, eq. 3.5). The shipped head rounds each logit to BF16
# (relative error up to 2^-9), far outside that bound at this width.
# -----------------------------------------------------------------------------


def test_lm_head_fp32_is_the_float64_product_on_both_stacks_and_undone_bitwise(vllm_probe):
    probe, hf, vm = vllm_probe, vllm_probe.train.model, vllm_probe.infer.model
    x = rand(23, hf.config.hidden_size, dtype=torch.bfloat16, seed=11)  # final-norm outputs, one row per token
    weight = hf.lm_head.weight.double()
    exact = x.double() @ weight.T
    k = hf.config.hidden_size
    bound = k * U / (1 - k * U) * (x.double().abs() @ weight.abs().T)
    with torch.inference_mode():
        shipped_hf, shipped_vllm = hf.lm_head(x), vm.logits_processor(vm.lm_head, x.clone())
        with aligned([probe.train, probe.infer], ["lm_head"]):
            a_hf, a_vllm = hf.lm_head(x), vm.logits_processor(vm.lm_head, x.clone())
        after_hf, after_vllm = hf.lm_head(x), vm.logits_processor(vm.lm_head, x.clone())
    assert a_hf.dtype == a_vllm.dtype == torch.float32
    assert torch.equal(a_hf, a_vllm)  # the same FP32 GEMM on the same rows
    assert ((a_hf.double() - exact).abs() <= bound).all()
    assert not ((shipped_hf.double() - exact).abs() <= bound).all()  # the shipped BF16 logits are not (test can fail)
    assert shipped_hf.dtype == torch.bfloat16
    assert torch.equal(after_hf, shipped_hf) and torch.equal(after_vllm, shipped_vllm)  # off: the shipped head


def test_lm_head_logprobs_come_from_the_fp32_logits_on_both_stacks(vllm_probe, prompts_file):
    """A compare with lm_head aligned takes both stacks' logprobs from FP32 logits with no rounding in between: each
    stack's scores carry FP32 logits whose FP32 log_softmax is the run's logprob (on the engine, vLLM's own reported
    logprobs must equal it at a gap of 0: the logits check in engines/vllm/stack.py), and the BF16-rounded logits
    would give other logprobs."""
    from divergence_probe.numerics.metrics import token_logprobs
    from divergence_probe.prompts import load_prompts

    shipped = vllm_probe.compare(prompts=prompts_file, taps="none")
    run = vllm_probe.compare(prompts=prompts_file, taps="none", align="lm_head")
    assert run.manifest["align"] == {"regions": ["lm_head"], "side": "both"}
    prompts = load_prompts(prompts_file, vllm_probe.tokenizer, max_model_len=vllm_probe.settings.max_model_len)
    rows = run.tokens_table[run.tokens_table.prompt_id == prompts[0].prompt_id]
    targets = torch.tensor(prompts[0].token_ids[1:])
    for stack, column in ((vllm_probe.infer, "logprob_infer"), (vllm_probe.train, "logprob_train")):
        assert not run.tokens_table[column].equals(shipped.tokens_table[column])
        with aligned([stack], ["lm_head"]):  # the engine batched as compare batches it; the trainer one at a time
            scores = stack.score_batched(prompts)[0] if stack is vllm_probe.infer else \
                stack.score(prompts, frozenset(), lambda *a: None)[0]
        assert scores.logits.dtype == torch.float32
        logprobs = torch.tensor(rows[column].values, dtype=torch.float32)
        assert torch.equal(logprobs, token_logprobs(scores.logits, targets))
        assert not torch.equal(logprobs, token_logprobs(scores.logits.bfloat16(), targets))


def test_lm_head_on_one_side_refuses_what_pairs_the_logits():
    """One side's logits FP32, the other's BF16: the logits tap cannot be paired, so it is refused before anything loads
    (the logprobs and KL are still compared: --taps none)."""
    from divergence_probe.errors import ProbeError
    from divergence_probe.spec import spec_from_flat

    for flags in ({"align": "lm_head", "side": "train"}, {"regions": "rope,lm_head", "side": "infer", "taps": "logits"},
                  {"align": "lm_head", "side": "train", "taps": "none", "graft": True}):
        kind = "ablate" if "regions" in flags else "compare"
        with pytest.raises(ProbeError, match="the logits tap cannot be paired") as e:
            spec_from_flat(kind, **flags)
        assert "\n" not in str(e.value)
    assert spec_from_flat("ablate", regions="rope,lm_head", side="train", taps="none").ablate.regions == ("rope", "lm_head")
    assert spec_from_flat("compare", align="lm_head").align.regions == ("lm_head",)  # both sides: every tap pairs


# -----------------------------------------------------------------------------
# residual: the stream in FP32 (regions/residual.py). The stream entering a norm is the running sum of the embedding
# and the k branch outputs added before it, each exactly upcast; recursive FP32 summation is within
# gamma_k * sum|terms| of the exact sum (Higham eq. 4.4; gamma_k = k U / (1 - k U)). The shipped stream rounds every
# partial sum to BF16 (relative 2^-9), which that bound cannot hold. Each norm reading the stream is the aligned norm
# of its FP32 input: rounding_errors against the float64 norm of that input, as for rmsnorm.
# -----------------------------------------------------------------------------


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


def stream_check(model, seen: dict) -> tuple[float, int, int]:
    """(largest |stream - exact| / bound over every point the stream is read, norm outputs not R(y) for a y within the
    FP32 bound of the exact norm of their input, worst ULP distance of those) of one captured forward; exact: the
    float64 running sum of the embedding and every attention and MLP output added into the stream."""
    n, layers = model.config.num_hidden_layers, model.model.layers
    exact, magnitude, k = seen["model"]["embed"].double(), seen["model"]["embed"].double().abs(), 0
    worst, norm_errors = 0.0, []
    for i in range(n):
        t = seen[i]
        for branch, stream in (("o_proj", "stream"), ("mlp_out", "layer_out")):
            exact, magnitude, k = exact + t[branch].double(), magnitude + t[branch].double().abs(), k + 1
            worst = max(worst, float(((t[stream].double() - exact).abs() / (gamma(k) * magnitude)).max()))
        for got, s, norm in ((t["input_norm"], t["x_in"], layers[i].input_layernorm),
                             (t["post_norm"], t["stream"], layers[i].post_attention_layernorm)):
            want = rms_exact(s, norm.weight, norm.variance_epsilon)
            norm_errors.append(rounding_errors(got, want, rms_eps(want, s.shape[-1])))
    final = model.model.norm
    want = rms_exact(seen[n - 1]["layer_out"], final.weight, final.variance_epsilon)
    norm_errors.append(rounding_errors(seen["model"]["final_norm"], want, rms_eps(want, want.shape[-1])))
    return worst, sum(o for o, _ in norm_errors), max(u for _, u in norm_errors)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_residual_stream_is_the_fp32_sum_and_off_is_the_shipped_forward(hf_tiny, one_thread, arch):
    """Aligned (alone or with rmsnorm), the stream is FP32 and within the FP32 summation bound of the exact sum of what
    was added into it, and every norm reading it rounds its exact norm once; the shipped BF16 stream is not within
    that bound. Undone, the forward is the shipped one bit for bit."""
    model = hf_tiny[arch]
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(9))
    positions = torch.arange(40)
    snap = snapshot(model)
    with torch.inference_mode():
        shipped_logits = model(input_ids=ids).logits
    shipped, _, _ = stream_check(model, run_capturing(model, ids, positions))
    logits = {}
    for regions in (("residual",), ("rmsnorm", "residual")):
        with align.apply(model, regions):
            seen = run_capturing(model, ids, positions)
            with torch.inference_mode():
                logits[regions] = model(input_ids=ids).logits
        assert seen[1]["x_in"].dtype == seen[0]["layer_out"].dtype == torch.float32  # the stream between layers
        assert seen[0]["input_norm"].dtype == seen[0]["post_norm"].dtype == torch.bfloat16  # what the GEMMs read
        worst, outside, worst_ulp = stream_check(model, seen)
        assert worst <= 1 and outside == 0 and worst_ulp <= 1, (regions, worst, outside, worst_ulp)
        if "rmsnorm" in regions and arch == "qwen3":  # aligned together, rmsnorm still aligns q_norm/k_norm
            d, config = head_dim(model.config), model.config
            for i, layer in enumerate(model.model.layers):
                for name, heads in (("q", config.num_attention_heads), ("k", config.num_key_value_heads)):
                    norm = getattr(layer.self_attn, f"{name}_norm")
                    want = rms_exact(seen[i][f"{name}_proj"].view(-1, heads, d), norm.weight, norm.variance_epsilon)
                    assert rounding_errors(seen[i][f"{name}_norm"], want, rms_eps(want, d))[0] == 0, (i, name)
    assert shipped > 1  # the shipped stream is not the FP32 sum: the check tells them apart
    if arch == "qwen2":  # no q/k norms: with residual on, rmsnorm changes nothing
        assert torch.equal(logits[("residual",)], logits[("rmsnorm", "residual")])
    assert_unchanged(snap)
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, shipped_logits)


@pytest.mark.parametrize("regions", [("residual",), ("rmsnorm", "residual")])
def test_residual_vllm_norms_equal_patched_transformers(vllm_probe, hf_tiny, one_thread, regions):
    """vLLM's patched fused add+norms, fed what the patched transformers layers added, return the same FP32 stream and
    the same norm outputs bitwise; the q/k norms are rmsnorm's when it is aligned too and the shipped ones otherwise;
    undone, the engine's norms are the shipped ones."""
    hf, vm = hf_tiny["qwen3"], vllm_probe.infer.model
    config, d = hf.config, head_dim(hf.config)
    ids = torch.randint(0, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(6))
    with align.apply(hf, regions):
        seen = run_capturing(hf, ids, torch.arange(24))
    n = config.num_hidden_layers
    norm1 = vm.model.layers[1].input_layernorm
    with torch.inference_mode():
        probe_in = (seen[0]["mlp_out"].clone(), seen[0]["stream"].bfloat16())
        shipped = norm1(*(x.clone() for x in probe_in))
        heads = seen[0]["q_proj"].view(-1, config.num_attention_heads, d)
        shipped_q = vm.model.layers[0].self_attn.q_norm(heads.clone())
        with aligned([vllm_probe.infer], regions):
            for i, layer in enumerate(vm.model.layers[:n]):
                t = seen[i]
                if i == 0:
                    assert torch.equal(layer.input_layernorm(seen["model"]["embed"].clone()), t["input_norm"])
                else:
                    out, stream = layer.input_layernorm(seen[i - 1]["mlp_out"].clone(), seen[i - 1]["stream"].clone())
                    assert stream.dtype == torch.float32 and torch.equal(stream, t["x_in"])
                    assert torch.equal(out, t["input_norm"])
                out, stream = layer.post_attention_layernorm(t["o_proj"].clone(), t["x_in"].clone())
                assert torch.equal(out, t["post_norm"]) and torch.equal(stream, t["stream"])
                q = layer.self_attn.q_norm(t["q_proj"].view(-1, config.num_attention_heads, d).clone())
                assert torch.equal(q, t["q_norm"])
            final, _ = vm.model.norm(seen[n - 1]["mlp_out"].clone(), seen[n - 1]["stream"].clone())
            assert torch.equal(final, seen["model"]["final_norm"])
            q = vm.model.layers[0].self_attn.q_norm(heads.clone())
            assert torch.equal(q, shipped_q) != ("rmsnorm" in regions)  # residual alone leaves the q/k norms shipped
        after = norm1(*(x.clone() for x in probe_in))
        assert all(torch.equal(a, b) for a, b in zip(shipped, after))


def test_residual_and_rmsnorm_compose_on_both_stacks(vllm_probe, hf_tiny):
    """Aligned together, residual takes the targets it shares with rmsnorm (no overlap) and rmsnorm keeps the rest
    (Qwen3's q/k norms; on Qwen2 nothing)."""
    for arch, model in hf_tiny.items():
        n = model.config.num_hidden_layers
        with HookSet() as hooks:
            found = patch("hf", model, ("rmsnorm", "residual"), hooks)
        assert found == {"residual": 3 * n + 1, "rmsnorm": 2 * n if arch == "qwen3" else 0}, arch
    vm = vllm_probe.infer.model
    n = len(vm.model.layers)
    found = {region: len(r) for region, r in plan("vllm", vm, ("rmsnorm", "residual")).items()}
    assert found == {"rmsnorm": 2 * n, "residual": 2 * n + 1}


def test_residual_on_a_mixture_of_experts(qwen3_moe_tiny):
    """Qwen3-MoE's layers take the same patch: an FP32 stream between layers, other logits, undone bitwise."""
    model = load_hf(qwen3_moe_tiny)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    streams = []
    with torch.inference_mode(), HookSet() as hooks:
        hooks.after(model.model.layers[0], lambda m, a, k, o: streams.append(first_tensor(o)))
        shipped = model(input_ids=ids).logits
        with align.apply(model, ("rope", "rmsnorm", "residual")):
            on = model(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, shipped)
    assert [s.dtype for s in streams] == [torch.bfloat16, torch.float32, torch.bfloat16]
    assert not torch.equal(on, shipped)


def test_residual_on_one_side_refuses_what_pairs_the_stream():
    from divergence_probe.errors import ProbeError
    from divergence_probe.spec import spec_from_flat

    for flags in ({"align": "residual", "side": "train"}, {"regions": "rope,residual", "side": "infer",
                                                          "taps": "resid_out"},
                  {"align": "residual", "side": "train", "taps": "none", "graft": True}):
        kind = "ablate" if "regions" in flags else "compare"
        with pytest.raises(ProbeError, match="the resid_mid/resid_out taps cannot be paired") as e:
            spec_from_flat(kind, **flags)
        assert "\n" not in str(e.value)
    assert spec_from_flat("ablate", regions="rope,rmsnorm,residual").ablate.regions == ("rope", "rmsnorm", "residual")
    assert spec_from_flat("compare", align="residual", side="train", taps="none").align.regions == ("residual",)


def test_residual_is_what_an_amp_trainer_already_computes(hf_tiny):
    """Under AMP (FP32 weights, BF16 autocast) the shipped stream is FP32 and the norm's FP32 output is rounded once by
    autocast at the next GEMM: the region's forward, bit for bit (docs/reference/ablation.md says so)."""
    model = copy.deepcopy(hf_tiny["qwen3"]).float()
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        shipped = model(input_ids=ids).logits
        with align.apply(model, "residual"):
            assert torch.equal(model(input_ids=ids).logits, shipped)
