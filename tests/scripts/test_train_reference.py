"""scripts/train_reference_model.py at the tiny size on the CPU: the smoke test of the H200 reference model's script.
In process, on a 200 kB corpus slice, so it costs seconds; the process state the script sets (threads,
deterministic algorithms) is put back for the rest of the session."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def script():
    sys.path.insert(0, str(SCRIPTS))
    state = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_float32_matmul_precision())
    try:
        yield importlib.import_module("train_reference_model")
    finally:
        torch.set_num_threads(state[0])
        torch.use_deterministic_algorithms(state[1], warn_only=state[2])
        torch.set_float32_matmul_precision(state[3])
        sys.path.remove(str(SCRIPTS))


def test_tiny_reference_model_trains_and_is_a_checkpoint_compare_loads(script, tmp_path):
    from transformers import AutoModelForCausalLM

    from divergence_probe.models.source import resolve_model

    out = tmp_path / "ref"
    report = script.main(["--size", "tiny", "--steps", "14", "--corpus-bytes", "200000", "--device", "cpu",
                          "--out", str(out), "--log-every", "2", "--eval-every", "14"])
    log = report["train"]["log"]
    assert log[-1]["train_loss"] < log[0]["train_loss"] - 0.5  # the loss falls
    loss = report["heldout_loss"]
    assert loss["reference"] < loss["init"] - 0.5 and abs(loss["init"] - loss["uniform"]) < 0.5
    assert all(math.isfinite(loss[k]) for k in ("builtin", "unigram"))
    assert json.loads((out / "training.json").read_text()) == report
    corpus = report["corpus"]  # sorted stdlib first: __future__.py, the first held-out module, is left out
    assert corpus["bytes"] <= 200000 and corpus["skipped"]["heldout_copy"] >= 1 and corpus["cap_reached"]
    assert corpus["first"] == "stdlib/__hello__.py" and corpus["heldout_files"][0] == "__future__.py"

    source = resolve_model(str(out))  # what `compare --model` runs first: config, weights and tokenizer checks
    assert source.config["model_type"] == "qwen3" and source.config["head_dim"] == 128
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == report["model"]["params"]

    acts = report["activations"]
    assert [len(acts[k]) for k in ("reference", "init", "builtin")] == [2, 2, 4]
    for row in acts["reference"] + acts["init"]:
        assert row["max_over_median"] > 1 and 0 < row["attn_entropy"] <= acts["uniform_attn_entropy"] + 1e-3
        assert 0 < row["attn_first_token"] <= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line_before_anything_is_written(script, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        script.main(["--size", "tiny", "--device", "cuda", "--out", str(tmp_path / "ref")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cpu" in err
    assert not (tmp_path / "ref").exists()
