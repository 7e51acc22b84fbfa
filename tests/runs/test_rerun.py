"""`rerun` on the real stacks (vLLM vs transformers, CPU): the manifest's spec re-makes the run byte for byte."""

from __future__ import annotations

import pytest

from test_toy_cli import cli, same_csvs

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child


@pytest.mark.slow
@pytest.mark.parametrize("kind, extra", [
    ("compare", ["--taps", "all"]),
    ("compare", ["--mode", "generate", "--max-new-tokens", "6", "--temperature", "0.5", "--top-p", "0.5",
                 "--taps", "resid_out,logits"]),
    ("ablate", ["--regions", "rope,swiglu", "--side", "both", "--taps", "none", "--bootstrap", "20"]),
])
def test_rerun_reproduces_a_vllm_run(vllm_probe, qwen3_tiny, prompts_file, tmp_path, kind, extra):
    # the same load settings as the session's engine, so the CLI reuses it (one vLLM engine per process on CPU)
    load = ["--model", qwen3_tiny, "--infer", "vllm", "--device", "cpu", "--dtype", "bfloat16", "-n", "2"]
    cli(kind, *load, "--prompts", prompts_file, *extra, "--out", tmp_path / "first")
    cli("rerun", tmp_path / "first", "--out", tmp_path / "again")
    names = same_csvs(tmp_path / "first", tmp_path / "again")
    assert "tokens.csv" in names and "summary.csv" in names
