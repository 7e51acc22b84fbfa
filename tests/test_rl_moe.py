"""rl on a mixture of experts (tiny Qwen3-MoE): routing replay (R3) over training, the routing mismatch per step, and
the weight-sync check of the experts. One engine, in tests/rl_moe_driver.py's process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from divergence_probe.errors import StackError
from divergence_probe.stacks.hooks import HookSet
from divergence_probe.stacks.vllm.rollout import RolloutRecorder
from divergence_probe.taps import TapKey

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rl_moe(qwen3_moe_tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-moe")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "rl_moe_driver.py"), str(qwen3_moe_tiny), str(root)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return root, json.loads(line.removeprefix("RESULT "))


def test_rl_runs_on_moe_with_and_without_replay(rl_moe):
    root, seen = rl_moe
    rows = pd.read_csv(root / "run" / "rl.csv")
    assert list(rows.setting) == ["none", "routing"] == seen["settings"]
    assert rows.frac_response_any_flip.between(0, 1).all()
    assert (rows.sync_tensors > 20).all() and rows.sync_audited.all()  # every push checked on the device and by sha256
    assert json.loads((root / "run" / "manifest.json").read_text())["spec"]["setting"] == ["none", "routing"]
    assert all(n > 0 for n in seen["cached_rows"])  # the prefix cache served rows whose routes were filled in


def test_replay_runs_the_engines_experts_for_every_response_token_and_layer(rl_moe):
    _, seen = rl_moe
    replay, own = seen["replay"], seen["own"]
    assert replay["rows_layers_equal"] == replay["rows_layers"] > 0  # the ids the experts got are the engine's
    # without replay the trainer runs its own pick, and the rl.csv column is the share of response tokens where that
    # pick's set differs from the engine's in some layer, counted independently here from what the experts got
    assert own["metric"] == own["ran_flip_frac"]
    assert replay["ran_flip_frac"] == 0.0


def test_sync_check_catches_a_skipped_expert_tensor(rl_moe):
    _, seen = rl_moe
    assert seen["skipped_expert"].startswith("SyncError")
    assert "model.layers.1.mlp.experts.routed_experts.w2_weight" in seen["skipped_expert"]
    assert "model.layers.1.mlp.experts.down_proj" in seen["skipped_expert"]


def test_sync_check_catches_experts_left_in_checkpoint_layout_by_vllms_reload(rl_moe):
    """vLLM's reload alone does not re-run the experts kernel's layout (prepack on the CPU): the check names w13."""
    _, seen = rl_moe
    assert seen["reload_alone"].startswith("SyncError") and "w13_weight" in seen["reload_alone"]


def _recorder(steps: list[tuple[list[tuple[str, int, int]], list[int]]], ids: list[list[int]]) -> RolloutRecorder:
    """A recorder fed by hand: steps of (spans (request, first position, rows), input ids), and the expert_ids rows
    of one layer (top-1) in step order."""
    runner = SimpleNamespace(input_batch=None, query_start_loc=None)
    recorder = RolloutRecorder(runner, HookSet())
    for spans, tokens in steps:
        starts = np.cumsum([0] + [n for _, _, n in spans])
        runner.input_batch = SimpleNamespace(num_reqs=len(spans), req_ids=[r for r, _, _ in spans],
                                             num_computed_tokens_cpu=np.array([p for _, p, _ in spans]))
        runner.query_start_loc = SimpleNamespace(np=starts)
        recorder.begin_step(torch.tensor(tokens))
    recorder.add_tap(TapKey.of("expert_ids", 0), torch.tensor(ids)[:, None])
    return recorder


def test_routes_of_prefix_cached_rows_come_from_the_request_that_computed_them():
    # step 1: request a computes its prompt [5, 6, 7]; step 2: b (same prompt) was served 2 rows from the cache and
    # computes position 2, a decodes position 3; c shares only the first token and computes everything
    recorder = _recorder([([("a-x", 0, 3)], [5, 6, 7]),
                          ([("b-y", 2, 1), ("a-x", 3, 1), ("c-z", 0, 3)], [7, 9, 5, 8, 7])],
                         [[10], [11], [12], [20], [13], [30], [31], [32]])
    routes = recorder.routes({"a": (5, 6, 7, 9, 4), "b": (5, 6, 7, 1), "c": (5, 8, 7, 2)}, num_layers=1)
    assert routes["a"][:, 0, 0].tolist() == [10, 11, 12, 13]
    assert routes["b"][:, 0, 0].tolist() == [10, 11, 20]  # rows 0-1 from a, row 2 its own
    assert routes["c"][:, 0, 0].tolist() == [30, 31, 32]
    with pytest.raises(StackError, match="no step computed position 0"):  # a prefix nobody computed
        recorder.routes({"b": (4, 6, 7, 1)}, num_layers=1)


@pytest.mark.parametrize("model, flags, message", [
    ("qwen3_tiny", ["--setting", "none", "--setting", "routing"], "region routing does not exist in qwen3 models"),
    ("qwen3_moe_tiny", ["--engine", "compiled", "--side", "train"], "rl --engine compiled is not supported for mixture-of-experts models"),
])
def test_what_rl_cannot_do_for_a_model_is_refused_before_loading(model, flags, message, request, tmp_path):
    from typer.testing import CliRunner

    from divergence_probe.cli import app
    from test_compare_cli import assert_nothing_written, assert_one_line_error

    result = CliRunner().invoke(app, ["rl", "--model", str(request.getfixturevalue(model)), *flags, "--device", "cpu",
                                      "--out", str(tmp_path / "x")])
    assert_one_line_error(result, message)
    assert_nothing_written(tmp_path / "x")
