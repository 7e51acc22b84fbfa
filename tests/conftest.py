"""Shared fixtures: tiny Qwen2/Qwen3 checkpoints built once per session, and one loaded Probe per stack pair.

vLLM's CPU backend can host one engine per process, so every in-process vLLM test shares the session's
`vllm_probe` (tiny Qwen3); Qwen2 through vLLM runs in a subprocess (test_compare_cli.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # CI has no model hub; a hub lookup must fail fast, not hang

import divergence_probe as dp  # noqa: E402
from divergence_probe.modelzoo import make_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def qwen3_tiny(models_dir) -> Path:
    return make_model(models_dir / "qwen3-tiny", arch="qwen3", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def qwen2_tiny(models_dir) -> Path:
    return make_model(models_dir / "qwen2-tiny", arch="qwen2", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    """Three short, varied prompts: enough to exercise batching and mapping, cheap enough for CI."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text(
        "The quick brown fox jumps over the lazy dog, and then it rests.\n\n"
        "def add(a, b):\n    return a + b  # small code prompt\n\n"
        "Die Rundung in BF16 verliert Stellen: 1 + 2**-9 == 1.\n"
    )
    return path


@pytest.fixture(scope="session")
def vllm_probe(qwen3_tiny):
    """The one vLLM engine of this test process (tiny Qwen3, BF16, CPU)."""
    probe = dp.load(str(qwen3_tiny), infer="vllm", dtype="bfloat16", device="cpu")
    yield probe
    probe.close()


@pytest.fixture(scope="session")
def hf_probe(qwen3_tiny):
    """Two independent transformers instances of the same checkpoint: the zero baseline."""
    probe = dp.load(str(qwen3_tiny), infer="hf", dtype="bfloat16", device="cpu")
    yield probe
    probe.close()


@pytest.fixture
def toy():
    """The toy stacks (`toy`, `toy-fused`) and region (`toy-align`) of tests/toy_stack.py, registered through the
    same registries as the shipped ones for the duration of a test."""
    from divergence_probe.regions import REGIONS
    from divergence_probe.stacks import register_stack

    removers = [register_stack("toy", "toy_stack:ToyStack"), register_stack("toy-fused", "toy_stack:FusedToyStack")]
    REGIONS["toy-align"] = "toy_stack:TOY_ALIGN"
    try:
        yield
    finally:
        REGIONS.pop("toy-align")
        for remove in removers:
            remove()
