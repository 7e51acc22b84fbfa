"""Qwen3-MoE through compare: every tap of the family captured on both stacks, router_logits diffed like
every tap, and what the family cannot do yet refused in one line before loading.

vLLM's CPU backend hosts one engine per process and the session's engine is the tiny dense Qwen3, so the MoE runs go
through the CLI in subprocesses: one vLLM run per module, read by several tests.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from divergence_probe.models import get_family

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

FAMILY = get_family("qwen3_moe")


@pytest.fixture(scope="module")
def moe_tiny(qwen3_moe_tiny):
    return qwen3_moe_tiny


def _compare(model, prompts, out, *extra):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "divergence_probe", "compare", "--model", str(model), "--taps", "all",
                           "--device", "cpu", "-p", str(prompts), "--out", str(out), *extra],
                          capture_output=True, text=True, env=env, timeout=600)


def _layers(run):
    with open(run / "layers.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def vllm_run(moe_tiny, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "vllm"
    done = _compare(moe_tiny, prompts_file, out)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_every_family_tap_on_both_sides(vllm_run, moe_tiny):
    rows = _layers(vllm_run)
    num_layers = 2  # the tiny preset's depth
    got = {(r["tap"], int(r["layer"])) for r in rows}
    assert got == {(t, i) for t in FAMILY.layer_taps for i in range(num_layers)} | \
        {(t, i) for (t, i) in got if t in ("embed", "final_norm", "logits")}
    assert not {t for t, _ in got} & {"gate_proj", "up_proj", "swiglu"}  # a sparse layer has no dense MLP taps


def test_router_logits_differ_between_stacks(vllm_run):
    """The engine's router logits are not the trainer's (different GEMM kernels): captured, not zero-filled."""
    routers = [r for r in _layers(vllm_run) if r["tap"] == "router_logits"]
    assert len(routers) == 2 and all(float(r["rel_l2"]) > 0 for r in routers)


def test_hf_baseline_router_logits_bitwise(moe_tiny, prompts_file, tmp_path):
    """Two transformers instances: the zero baseline holds for the router too."""
    done = _compare(moe_tiny, prompts_file, tmp_path / "hf", "--infer", "hf")
    assert done.returncode == 0, done.stderr[-2000:]
    routers = [r for r in _layers(tmp_path / "hf") if r["tap"] == "router_logits"]
    assert len(routers) == 2 and all(float(r["max_abs"]) == 0.0 for r in routers)


def test_unsupported_refused_in_one_line(moe_tiny, prompts_file, tmp_path):
    done = _compare(moe_tiny, prompts_file, tmp_path / "x", "--engine-args", '{"tensor_parallel_size": 2}')
    assert done.returncode == 2
    assert "not supported for Qwen3-MoE yet" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()



def test_alternate_placement_writes_the_same_files(vllm_run, moe_tiny, prompts_file, tmp_path):
    """--placement alternate (the engine first, in a worker, then the trainer alone): the same tokens, layers, summary
    and routing, byte for byte, as the run with both stacks together."""
    import divergence_probe as dp
    from divergence_probe.spec import spec_from_flat

    spec = spec_from_flat("compare", model=str(moe_tiny), taps="all", device="cpu", prompts=str(prompts_file),
                          placement="alternate")
    dp.run(spec, spill_near=tmp_path / "alternate").write(tmp_path / "alternate")
    for name in ("tokens.csv", "layers.csv", "summary.csv", "routing.csv"):
        assert (tmp_path / "alternate" / name).read_bytes() == (vllm_run / name).read_bytes(), name
