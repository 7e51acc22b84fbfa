"""The engine-neutral weight comparison: the trainer's tensors mapped as an engine's loader maps them, compared exactly
(a ULP anywhere is a difference; equal values across dtypes are not)."""

from __future__ import annotations

import pytest
import torch

from divergence_probe.engines.weight_check import differing, digests, expected_tensors, fingerprints, same_values
from divergence_probe.errors import SyncError
from divergence_probe.models import get_family


def test_expected_tensors_stack_like_vllms_loader():
    t = {f"model.layers.0.self_attn.{p}_proj.weight": torch.full((2, 3), float(i)) for i, p in enumerate("qkv")}
    t["model.embed_tokens.weight"] = torch.randn(5, 3)
    engine = ["model.layers.0.self_attn.qkv_proj.weight", "model.embed_tokens.weight", "lm_head.weight"]
    head = get_family("qwen2").tied_head
    want = expected_tensors(t, engine, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, tied_head=head)
    qkv = want["model.layers.0.self_attn.qkv_proj.weight"]  # the sources in vLLM's stacking order, not a copy
    assert [name for name, _ in qkv] == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert all(part is t[name] for name, part in qkv)
    [(name, head_weight)] = want["lm_head.weight"]
    assert name == "model.embed_tokens.weight" and head_weight is t[name]
    with pytest.raises(SyncError, match="model.extra.weight"):
        expected_tensors({**t, "model.extra.weight": torch.ones(1)}, engine, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
                         tied_head=head)


def test_the_on_device_comparison_matches_equal_values_across_dtypes_and_tells_one_ulp():
    w = torch.randn(4, 3).bfloat16()
    bumped = w.clone()
    bumped.view(torch.int16)[1, 2] += 1  # one unit in the last place
    for engine in (w.clone(), w.float()):  # same dtype, and an engine that keeps it in FP32
        assert bool(same_values(engine, w)) and not bool(same_values(engine, bumped))
    assert fingerprints([w])[0] != fingerprints([bumped])[0]


def test_the_batched_comparison_finds_exactly_the_differing_pairs():
    """`differing` flags one ULP anywhere, a subnormal one included, in any chunk; +0 vs -0 and inf vs inf are equal
    (element-wise ==, which its fast path of difference norms must not overrule); NaN is never equal."""
    g = torch.Generator().manual_seed(0)
    have = [torch.randn(n, 5, generator=g).bfloat16() for n in (1, 7, 300, 2, 40)]
    want = [t.clone() for t in have]
    assert differing(have, want) == [] and differing(have, want, chunk_bytes=1) == []
    want[2].view(torch.int16)[123, 4] += 1  # one unit in the last place
    tiny = torch.tensor([1e-39, 0.0]).bfloat16()  # a subnormal BF16 against zero
    have += [tiny, torch.tensor([0.0, float("inf")]).bfloat16(), torch.tensor([float("nan")]).bfloat16()]
    want += [torch.zeros(2).bfloat16(), torch.tensor([-0.0, float("inf")]).bfloat16(),
             torch.tensor([float("nan")]).bfloat16()]
    assert tiny[0] != 0
    for chunk in (1, 64, 1 << 28):
        assert differing(have, want, chunk_bytes=chunk) == [2, 5, 7]


def test_digests_match_equal_values_across_dtypes_and_tell_one_ulp():
    w = torch.randn(4, 3).bfloat16()
    bumped = w.clone()
    bumped.view(torch.int16)[1, 2] += 1  # one unit in the last place
    for engine in (w.clone(), w.float()):  # same dtype (raw bytes), and an engine that keeps it in FP32
        have, need = digests(engine, w)
        assert have == need
        have, need = digests(engine, bumped)
        assert have != need
