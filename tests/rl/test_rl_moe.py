"""rl on a mixture of experts (tiny Qwen3-MoE): routing replay (R3) over training, the routing mismatch per step, and
the weight-sync check of the experts, on the eager engine and on the compiled one (routes recorded at its tap
points). One engine per tests/rl_moe_driver.py process, one process per engine mode."""

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
from divergence_probe.engines.hooks import HookSet
from divergence_probe.engines.vllm.rollout import RolloutRecorder
from divergence_probe.taps import TapKey

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

REPO = Path(__file__).resolve().parents[2]


_DRIVEN: dict[str, tuple[Path, dict]] = {}  # engine mode -> (its folder, what its driver saw): one process each


def _driven(mode: str, model: Path, tmp_path_factory) -> tuple[Path, dict]:
    if mode not in _DRIVEN:
        root = tmp_path_factory.mktemp(f"rl-moe-{mode}")
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "rl_moe_driver.py"), str(model), str(root), mode],
                              cwd=root, env=env, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
        _DRIVEN[mode] = root, json.loads(line.removeprefix("RESULT "))
    return _DRIVEN[mode]


@pytest.fixture(scope="module", params=["eager", "compiled"])
def rl_moe(request, qwen3_moe_tiny, tmp_path_factory):
    return _driven(request.param, qwen3_moe_tiny, tmp_path_factory)


@pytest.fixture(scope="module")
def rl_moe_eager(qwen3_moe_tiny, tmp_path_factory):
    return _driven("eager", qwen3_moe_tiny, tmp_path_factory)


@pytest.fixture(scope="module")
def rl_moe_compiled(qwen3_moe_tiny, tmp_path_factory):
    return _driven("compiled", qwen3_moe_tiny, tmp_path_factory)


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


def test_compiled_rollout_routes_are_the_eager_engines_up_to_rounding(rl_moe_eager, rl_moe_compiled):
    """The same fixed rollouts (prompt rows, rows served from the prefix cache, decoded rows) through the eager engine
    (hooks) and the compiled one (tap points), at the checkpoint's weights. Each engine's recorded routes are a top-k
    of its own router logits in every row and layer. Where the two engines' router logits are bitwise equal, the
    routes must be too; on the CPU build that is no row (Inductor keeps the residual stream in FP32 and rounds
    elsewhere: docs/reference/rl.md), so the routes are also compared where rounding cannot explain a difference:
    in every row whose compiled top-k margin (k-th minus (k+1)-th logit) is over twice the largest difference between
    the two engines' logits of that row, no logit can overtake another, so both records must name the same experts
    (a row filed under another position or sequence would not); every set that differs lies within that bound."""
    from divergence_probe.numerics import routing

    eager, compiled = (torch.load(root / "same_tokens.pt") for root, _ in (rl_moe_eager, rl_moe_compiled))
    assert compiled["cached_rows"] == eager["cached_rows"] and max(eager["cached_rows"]) > 0
    k = eager["expert_ids"][0].shape[-1]
    rows = decisive = differ = 0
    for te, tc, ie, ic, le, lc in zip(eager["tokens"], compiled["tokens"], eager["expert_ids"],
                                      compiled["expert_ids"], eager["router_logits"], compiled["router_logits"]):
        agree = next((i for i, (a, b) in enumerate(zip(te, tc)) if a != b), min(len(te), len(tc)))
        fed = min(agree, len(ie), len(ic))  # rows 0..fed-1 ran on the same tokens in both engines
        assert fed >= len(ie) - 6  # the prompt's rows at least (the responses are 6 tokens)
        for layer in range(ie.shape[1]):
            for ids, logits in ((ie, le), (ic, lc)):
                assert routing.is_admissible_topk(logits[:, layer], ids[:, layer]).all(), layer
            a, b = le[:fed, layer].double(), lc[:fed, layer].double()  # BF16 differences, exact in FP64
            bound = 2 * (a - b).abs().amax(dim=-1)
            top = b.sort(dim=-1, descending=True).values
            same = (ie[:fed, layer].sort(dim=-1).values == ic[:fed, layer].sort(dim=-1).values).all(dim=-1)
            sure = top[:, k - 1] - top[:, k] > bound
            assert same[sure].all(), f"layer {layer}: routes differ where rounding cannot reorder the top-{k}"
            exact = (le[:fed, layer] == lc[:fed, layer]).all(dim=-1)  # one router's logits in both: one route
            assert (ie[:fed, layer] == ic[:fed, layer]).all(dim=-1)[exact].all()
            rows += fed
            decisive += int(sure.sum())
            differ += int((~same).sum())
    assert decisive > rows // 2 and differ > 0  # most rows decide; the flips the replay exists for do occur


def _recorder(steps: list[tuple[list[tuple[str, int, int]], list[int]]], ids: list[list[int]]) -> RolloutRecorder:
    """A recorder fed by hand: steps of (spans (request, first position, rows), input ids), and the expert_ids rows
    of one layer (top-1) in step order."""
    from vllm_runners import V1Runner

    runner = V1Runner(input_batch=None, query_start_loc=None)
    recorder = RolloutRecorder(runner, HookSet())
    for spans, tokens in steps:
        starts = np.cumsum([0] + [n for _, _, n in spans])
        runner.input_batch = SimpleNamespace(num_reqs=len(spans), req_ids=[r for r, _, _ in spans],
                                             num_computed_tokens_cpu=np.array([p for _, p, _ in spans]))
        runner.query_start_loc = SimpleNamespace(np=starts)
        recorder.begin_step(torch.tensor(tokens))
    recorder.add_tap(TapKey.of("expert_ids", 0), torch.tensor(ids)[:, None])
    return recorder


def test_stale_compiled_route_buffers_are_refused_by_the_replay(rl_moe_compiled):
    """Route buffers the compiled graph did not write (zeroed before the host reads them) reach the replaying update
    as rows of one expert k times: the step refuses them instead of training on them."""
    _, seen = rl_moe_compiled
    assert seen["stale_routes"].startswith("StackError") and "distinct experts" in seen["stale_routes"]
    assert seen["engine_tap_points"] == ["expert_ids", "expert_weights", "router_logits"]


def test_padded_rows_of_a_step_are_no_requests_rows():
    """A CUDA-graph step runs a padded batch: its rows past the last request's span (here 99) belong to no request,
    in a prefill step and in a decode step."""
    recorder = _recorder([([("a-x", 0, 3)], [5, 6, 7, 0]), ([("a-x", 3, 1)], [9, 0, 0, 0])],
                         [[10], [11], [12], [99], [13], [99], [99], [99]])
    assert recorder.routes({"a": (5, 6, 7, 9, 4)}, num_layers=1)["a"][:, 0, 0].tolist() == [10, 11, 12, 13]


def test_a_recomputed_or_missing_position_is_one_line_naming_it():
    """Generate mode pairs one engine computation per position: a request vLLM preempted and recomputed is refused
    with the cause and the fix, and rows that do not spell the sequence say where they depart from it."""
    preempted = _recorder([([("a-x", 0, 3)], [5, 6, 7]), ([("a-x", 0, 4)], [5, 6, 7, 9])], [[1]] * 7)
    with pytest.raises(StackError, match="position 0 was computed twice .*preempted.*kv_cache_memory_bytes"):
        preempted.stitch("a-x", (5, 6, 7, 9, 4), 0, lambda *_: None)
    short = _recorder([([("a-x", 0, 3)], [5, 6, 7])], [[1]] * 3)
    with pytest.raises(StackError, match=r"only positions 0-2 of 4 were fed"):
        short.stitch("a-x", (5, 6, 7, 9, 4), 0, lambda *_: None)
    with pytest.raises(StackError, match="position 2 was fed token 7, the sequence has 8"):
        short.stitch("a-x", (5, 6, 8, 9), 0, lambda *_: None)


def test_the_row_async_scheduling_feeds_after_a_stop_belongs_to_no_position():
    """vLLM's async scheduling (its default on CUDA) plans a step before it reads the previous one's samples, so a
    request that sampled its stop token (here 4) is fed it once more and vLLM discards the result: that row, and the
    sampler's logits row of it, are no position of the sequence. A fed token other than the last is still refused."""
    steps = [([("a-x", 0, 3)], [5, 6, 7, 0]), ([("a-x", 3, 1)], [9, 0]), ([("a-x", 4, 1)], [4, 0])]
    ids = [[10], [11], [12], [99], [13], [99], [14], [99]]
    recorder = _recorder(steps, ids)
    assert recorder.routes({"a": (5, 6, 7, 9, 4)}, num_layers=1)["a"][:, 0, 0].tolist() == [10, 11, 12, 13]
    recorder.logits["a-x"] = {p: torch.full((3,), float(p)) for p in range(4)}  # positions 0-3, as generate files them
    recorder.add_logits(torch.zeros(1, 2), torch.full((1, 3), 9.0))  # the discarded step's sampler row: position 4
    taps = []
    logits = recorder.stitch("a-x", (5, 6, 7, 9, 4), 0, lambda _, key, rows: taps.append(rows[:, 0].tolist()))
    assert logits[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0] and taps == [[10, 11, 12, 13]]
    with pytest.raises(StackError, match="position 4 was fed but the sequence has 4"):
        _recorder(steps, ids).routes({"a": (5, 6, 7, 9, 8)}, num_layers=1)
    with pytest.raises(StackError, match="do not spell its sequence"):
        _recorder(steps, ids).stitch("a-x", (5, 6, 7, 9, 8), 0, lambda *_: None)
    synchronous = _recorder(steps, ids)  # an engine that schedules synchronously never feeds it: a seam that moved
    synchronous.async_scheduling = False
    with pytest.raises(StackError, match="position 4 was fed but the sequence has 4"):
        synchronous.routes({"a": (5, 6, 7, 9, 4)}, num_layers=1)


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
    ("qwen3_moe_tiny", ["--engine", "compiled", "--engine-args", '{"enable_dbo": true}'],
     "enable_dbo=True: vLLM would run each step as micro-batches"),
])
def test_what_rl_cannot_do_for_a_model_is_refused_before_loading(model, flags, message, request, tmp_path):
    from typer.testing import CliRunner

    from divergence_probe.cli import app
    from test_compare_cli import assert_nothing_written, assert_one_line_error

    result = CliRunner().invoke(app, ["rl", "--model", str(request.getfixturevalue(model)), *flags, "--device", "cpu",
                                      "--out", str(tmp_path / "x")])
    assert_one_line_error(result, message)
    assert_nothing_written(tmp_path / "x")
