"""metrics: ULP distance, diff statistics and their reductions, token logprobs and KL, against independent references."""

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from divergence_probe.numerics.metrics import DiffStats, blocks_first, diff_sums, token_kl, token_logprobs, ulp_distance


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ulp_distance_counts_representable_steps(dtype):
    one = torch.tensor([1.0, -2.0, 3.5], dtype=dtype)
    eps = torch.finfo(dtype).eps  # spacing just above 1.0
    assert ulp_distance(torch.tensor([1.0 + eps], dtype=dtype), one[:1]).item() == 1
    assert ulp_distance(torch.tensor([1.0 + 3 * eps], dtype=dtype), one[:1]).item() == 3
    assert ulp_distance(one, one).sum().item() == 0


def test_ulp_distance_across_zero_counts_both_sides():
    tiny = torch.finfo(torch.bfloat16).tiny
    a = torch.tensor([tiny], dtype=torch.bfloat16)
    b = -a
    zero = torch.zeros(1, dtype=torch.bfloat16)
    assert ulp_distance(a, b).item() == 2 * ulp_distance(a, zero).item()
    assert ulp_distance(zero, -zero).item() == 0  # -0 == +0


def test_diff_stats_hand_computed():
    test = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    ref = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    s = DiffStats.of(test, ref)
    assert s.n == 4 and s.n_equal == 3 and s.frac_equal == 0.75
    assert s.max_abs == 1.0 and s.mean_abs == 0.25
    assert s.rel_l2 == pytest.approx(1 / math.sqrt(1 + 4 + 9 + 25))
    assert s.cosine == pytest.approx((1 + 4 + 9 + 20) / (math.sqrt(30) * math.sqrt(39)))
    assert not s.bitwise_equal
    assert DiffStats.of(ref, ref).bitwise_equal and DiffStats.of(ref, ref).rel_l2 == 0.0


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(1, 7), st.integers(0, 2**16))
def test_merge_equals_stats_of_concatenation(rows_a, rows_b, seed):
    g = torch.Generator().manual_seed(seed)
    a1, a2 = torch.randn(rows_a, 3, generator=g), torch.randn(rows_b, 3, generator=g)
    b1, b2 = a1 + 1e-3 * torch.randn(rows_a, 3, generator=g), a2.clone()
    merged = DiffStats.of(a1, b1).merge(DiffStats.of(a2, b2))
    whole = DiffStats.of(torch.cat([a1, a2]), torch.cat([b1, b2]))
    assert merged.n == whole.n and merged.n_equal == whole.n_equal and merged.max_ulp == whole.max_ulp
    assert merged.rel_l2 == pytest.approx(whole.rel_l2, rel=1e-12)
    assert merged.mean_abs == pytest.approx(whole.mean_abs, rel=1e-12)


def test_diff_stats_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        DiffStats.of(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError):
        DiffStats.of(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16))


def test_token_kl_matches_definition_and_is_zero_on_identical_logits():
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(4, 11, generator=g).to(torch.bfloat16)
    q_logits = (p_logits.float() + 0.1 * torch.randn(4, 11, generator=g)).to(torch.bfloat16)
    lp = torch.log_softmax(p_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    expected = (lp.exp() * (lp - lq)).sum(-1)
    assert torch.allclose(token_kl(p_logits, q_logits, rows_per_chunk=3), expected, rtol=0, atol=1e-15)
    assert token_kl(p_logits, p_logits).abs().max().item() == 0.0
    assert (token_kl(p_logits, q_logits) > 0).all()


def test_token_logprobs_are_fp32_log_softmax_at_targets():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]], dtype=torch.bfloat16)
    got = token_logprobs(logits, torch.tensor([2, 0]))
    assert got.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1)[[0, 1], [2, 0]]
    assert torch.equal(got, expected)


def _ordered_reference(x: torch.Tensor) -> list[int]:
    """Independent ULP ordering, element by element in Python: sign-magnitude bits to a signed integer line."""
    int_dtype = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[x.dtype]
    bits = torch.iinfo(int_dtype).bits
    out = []
    for b in x.view(int_dtype).tolist():
        magnitude = b & ((1 << (bits - 1)) - 1)
        out.append(-magnitude if b < 0 else magnitude)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ulp_distance_matches_reference_on_random_bit_patterns(dtype):
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    info = torch.iinfo(int_dtype)
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(info.min, info.max, (4096,), generator=g, dtype=torch.int64).to(int_dtype).view(dtype)
            for _ in range(2))
    finite = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[finite], b[finite]
    want = [abs(x - y) for x, y in zip(_ordered_reference(a), _ordered_reference(b))]
    assert ulp_distance(a, b).tolist() == want


def _random_pair(rows: int, n: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    ref = (torch.randn(rows, n, generator=g) * torch.logspace(-3, 3, n)).to(dtype)
    test = (ref.float() * (1 + 1e-2 * torch.randn(rows, n, generator=g))).to(dtype)
    test[:, ::5] = ref[:, ::5]  # some bitwise-equal elements
    return test, ref


_REDUCTIONS = {
    "eager": diff_sums,
    "compiled": torch.compile(diff_sums, dynamic=True),
    # the GPU's layout (blocks of 64 first, then pairs), run here on the CPU: same function, other device
    "blocks first": blocks_first,
    "blocks first, compiled": torch.compile(blocks_first, dynamic=True),
}


@pytest.mark.parametrize("reduce", [pytest.param(name, marks=[pytest.mark.engine] if "compiled" in name else [])
                                    for name in _REDUCTIONS])  # compiled: torch.compile
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_diff_sums_within_documented_error_of_float64(reduce, dtype):
    """Counts and maxima exact; sums within metrics._row_sums' bound (4e-6 relative for 16-bit taps, whose block
    sums run in FP32; FP64 throughout for FP32 taps), on the blocked path and on lengths that are no multiple of 64,
    reducing whole rows (CPU) or blocks first (GPU; lengths that are multiples of 64)."""
    fn = _REDUCTIONS[reduce]
    bound = 1e-12 if dtype == torch.float32 else 4e-6
    for rows, n in ((3, 4096), (1, 3 * 64), (2, 4096 + 7)):
        if reduce.startswith("blocks") and n % 64:
            continue  # diff_sums reduces those whole rows on a GPU too
        test, ref = _random_pair(rows, n, dtype, seed=rows * n)
        got = fn(test, ref)
        t, r = test.double(), ref.double()
        d = t - r
        exact = torch.stack([(d == 0).sum(1).double(), d.abs().sum(1), d.abs().amax(1), (d * d).sum(1),
                             (r * r).sum(1), (t * t).sum(1), ulp_distance(test, ref).amax(1).double()], dim=1)
        assert torch.equal(got[:, [0, 2, 6]], exact[:, [0, 2, 6]])
        assert ((got - exact).abs() <= bound * exact.abs()).all(), (got - exact).abs() / exact.abs()


def test_reduction_falls_back_to_eager_when_compiling_fails(monkeypatch, tmp_path):
    from divergence_probe import home
    from divergence_probe.numerics import fused

    monkeypatch.setenv(home.HOME_ENV, str(tmp_path))  # nothing saved by a compile that worked

    def broken(fn, **_):
        def run(*args):
            raise RuntimeError("no C compiler")
        return run

    monkeypatch.setattr(fused, "_compiled", None)
    monkeypatch.setattr(fused, "_backend", None)
    monkeypatch.setattr(torch, "compile", broken)
    test, ref = _random_pair(2, 128, torch.bfloat16, seed=0)
    with pytest.warns(RuntimeWarning, match="reducing eagerly"):
        got = fused.fused_diff_sums([test], [ref])
    assert torch.equal(got, diff_sums(test, ref))
    assert fused.backend() == "eager (torch.compile failed: RuntimeError)"


def test_dot_from_three_sums_is_accurate_for_nearly_equal_tensors():
    """cosine comes from ‖t‖², ‖r‖², ‖t−r‖²; for nearly equal tensors 1−cos must still be right (no cancellation)."""
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(4096, generator=g, dtype=torch.float64).to(torch.bfloat16)
    test = (ref.double() + 1e-3 * torch.randn(4096, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    t, r = test.double(), ref.double()
    exact = 1 - (t @ r / (t.norm() * r.norm())).item()
    assert exact > 0
    assert 1 - DiffStats.of(test, ref).cosine == pytest.approx(exact, rel=1e-6)


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_reduction_is_compiled_without_per_process_kernel_timing(monkeypatch):
    """Inductor's deterministic mode: kernel configs are not chosen by timing, so sums repeat across runs."""
    from divergence_probe.numerics import fused

    monkeypatch.delenv("DIVERGENCE_PROBE_EAGER", raising=False)
    monkeypatch.setattr(fused, "_compiled", None)
    monkeypatch.setattr(fused, "_backend", None)
    test, ref = _random_pair(2, 128, torch.bfloat16, seed=0)
    assert torch.equal(fused.fused_diff_sums([test], [ref])[:, [0, 2, 6]], diff_sums(test, ref)[:, [0, 2, 6]])
    assert fused.backend() == "torch.compile (inductor, deterministic)"


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_reduction_patterns_past_the_limit_run_eagerly_and_say_so(monkeypatch):
    """Past fused.PATTERN_LIMIT compiled graphs a new pattern of groups is reduced eagerly, and the manifest's
    backend says so (torch alone would switch to eager silently)."""
    from divergence_probe.numerics import fused

    monkeypatch.delenv("DIVERGENCE_PROBE_EAGER", raising=False)
    monkeypatch.setattr(fused, "_compiled", None)
    monkeypatch.setattr(fused, "_backend", None)
    monkeypatch.setattr(fused, "PATTERN_LIMIT", 1)
    pairs = [_random_pair(2, 128, dtype, seed=0) for dtype in (torch.bfloat16, torch.float16, torch.float32)]
    with pytest.warns(RuntimeWarning, match="reduced eagerly"):
        for groups in (pairs[:1], pairs[:2], pairs):  # three patterns: one, two, three groups
            tests, refs = zip(*groups)
            got = fused.fused_diff_sums(list(tests), list(refs))
            want = torch.cat([diff_sums(t, r) for t, r in groups])
            assert torch.equal(got[:, [0, 2, 6]], want[:, [0, 2, 6]])  # counts and maxima: exact on any path
    assert fused.backend().startswith("torch.compile (inductor") and fused.backend().endswith("ran eagerly")



@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_reduction_compiles_once_when_a_token_count_equals_a_feature_width(monkeypatch):
    """A prompt whose token count happens to equal a tap's width must not pin the two together in the compiled
    graph: the next prompt would compile it again (with one pattern allowed, it would run eagerly and say so)."""
    from divergence_probe.numerics import fused

    monkeypatch.delenv("DIVERGENCE_PROBE_EAGER", raising=False)
    monkeypatch.setattr(fused, "_compiled", None)
    monkeypatch.setattr(fused, "_backend", None)
    monkeypatch.setattr(fused, "PATTERN_LIMIT", 1)
    torch._dynamo.reset()  # the graphs earlier tests compiled count against the limit of one
    for tokens in (64, 65, 37):
        test, ref = _random_pair(2, tokens * 64, torch.bfloat16, seed=tokens)
        test, ref = test.view(2, tokens, 64), ref.view(2, tokens, 64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = fused.fused_diff_sums([test], [ref])
        assert torch.equal(got[:, [0, 2, 6]], diff_sums(test, ref)[:, [0, 2, 6]])
    assert fused.backend() == "torch.compile (inductor, deterministic)"



# ----------------------------------------------------------------------------- KL against independent references


def _kl_bound(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """What token_kl's float64 may be off by: log_softmax rounds x - logsumexp(x) to float64, so each log-prob
    carries an error of a couple of ULPs of the larger of |x| and |logsumexp|, and KL weighs their difference
    by p (sum 1). 8 ULPs of the largest such term; a float32 slip anywhere is off by 1e-7 relative or more."""
    scale = max(p_logits.double().abs().max().item(), q_logits.double().abs().max().item(),
                torch.logsumexp(p_logits.double(), -1).abs().max().item(),
                torch.logsumexp(q_logits.double(), -1).abs().max().item())
    return 8 * math.ulp(scale)


def test_token_kl_equals_mpmath_on_a_tiny_vocabulary():
    """50-digit mpmath straight from the definition, Σ p (log p - log q), on BF16 logits (exact in any precision):
    unrelated rows, rows one BF16 step apart in one logit, identical rows, and a peaked row."""
    import mpmath

    g = torch.Generator().manual_seed(5)
    p = torch.randn(6, 9, generator=g).mul(3).bfloat16()
    q = (p.float() + 0.3 * torch.randn(6, 9, generator=g)).bfloat16()
    q[1] = p[1]
    q[1, 4:5] = (p[1, 4:5].view(torch.int16) + 1).view(torch.bfloat16)  # the next BF16 value
    q[2] = p[2]  # identical: exactly 0
    p[3], q[3] = torch.tensor([30.0] + [-30.0] * 8).bfloat16(), torch.tensor([29.875] + [-30.0] * 8).bfloat16()
    mpmath.mp.dps = 50

    def log_softmax(row):
        xs = [mpmath.mpf(x) for x in row]
        lse = mpmath.log(mpmath.fsum(mpmath.exp(x) for x in xs))
        return [x - lse for x in xs]

    want = []
    for a, b in zip(p.double().tolist(), q.double().tolist()):
        la, lb = log_softmax(a), log_softmax(b)
        want.append(float(mpmath.fsum(mpmath.exp(x) * (x - y) for x, y in zip(la, lb))))
    got = token_kl(p, q, rows_per_chunk=4).tolist()
    assert got[2] == 0.0 and want[2] == 0.0 and min(want[:2] + want[3:]) > 0
    bound = _kl_bound(p, q)
    assert all(abs(g_ - w) <= bound for g_, w in zip(got, want)), [(g_ - w) / bound for g_, w in zip(got, want)]


def test_token_kl_at_full_vocabulary_with_large_logits_equals_an_extended_precision_reference():
    """Qwen's 151936-token vocabulary, logits spread over ±30 or peaked at +30 over a floor at -30 (where
    exp over- and underflows bite), against another formulation in 80-bit extended precision (numpy longdouble):
    KL = Σ p (x - y) - logsumexp(x) + logsumexp(y), with x - y exact."""
    assert np.finfo(np.longdouble).eps < 1e-18, "this platform has no extended precision for the reference"
    g = torch.Generator().manual_seed(6)
    vocab = 151936
    spread = torch.rand(vocab, generator=g) * 60 - 30
    peaked = torch.full((vocab,), -30.0) + torch.rand(vocab, generator=g)
    peaked[torch.randint(vocab, (8,), generator=g)] = torch.linspace(26, 30, 8)
    p = torch.stack([spread, peaked]).bfloat16()
    q = (p.float() + 0.05 * torch.randn(p.shape, generator=g)).bfloat16()
    got = token_kl(p, q).numpy()

    def lse(x):
        top = x.max()
        return top + np.log(np.exp(x - top).sum())

    want = []
    for a, b in zip(p.double().numpy().astype(np.longdouble), q.double().numpy().astype(np.longdouble)):
        la, lb = lse(a), lse(b)
        want.append((np.exp(a - la) * (a - b)).sum() - la + lb)
    want = np.array(want)
    assert (want > 0).all()
    assert (np.abs(got - want) <= _kl_bound(p, q)).all(), (got - want) / _kl_bound(p, q)


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_gpu_layout_reduces_a_strided_hand_over_as_its_contiguous_copy():
    """A compiled engine hands a prompt's taps over as rows of larger buffers ([taps, tokens, features], the other
    prompts' rows between its taps). The GPU's layout of the reduction, compiled as numerics/fused.py compiles it (run here on
    the CPU), gives such a view the sums of its contiguous copy, bit for bit, at every offset: it is the same
    computation whatever the offset. (On a GPU, Inductor's kernel for a view may sum in another order than the one for
    a copy: the last bits differ there, within the bound metrics._row_sums states.)"""
    reduce = torch.compile(blocks_first, dynamic=True, options={"deterministic": True})
    test, ref = _random_pair(3 * 96, 512, torch.bfloat16, seed=5)
    test, ref = test.view(3, 96, 512), ref.view(3, 96, 512)
    for first, tokens in ((0, 40), (40, 33), (73, 23)):
        view = test[:, first:first + tokens], ref[:, first:first + tokens]
        assert not view[0].is_contiguous()
        assert torch.equal(reduce(*view), reduce(*(x.contiguous() for x in view)))


def test_gpu_layout_reduces_taps_whose_rows_are_not_contiguous():
    """A tap whose features are not contiguous in memory (a transposed view, say) is reduced as its copy: the blocks
    of 64 are a view where they can be and a copy where they cannot, never an error."""
    test, ref = _random_pair(2 * 128, 40, torch.bfloat16, seed=7)
    test, ref = test.view(2, 128, 40).transpose(1, 2), ref.view(2, 128, 40).transpose(1, 2)
    assert not test.is_contiguous()
    assert torch.equal(blocks_first(test, ref), blocks_first(test.contiguous(), ref.contiguous()))
