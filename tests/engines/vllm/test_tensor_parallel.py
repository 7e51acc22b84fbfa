"""vLLM at tensor_parallel_size 2 (engines/vllm/tensor_parallel.py) on the CPU's two cores: gathered taps against the
session's in-process engine at 1, vLLM's own logprobs, the parallelism floor, the manifest, and what is refused.

One TP=2 engine in the whole file: a module fixture runs it in a process of its own (its ranks are spawned, which
needs a `__main__` guard, and this process may hold the session's engine already), where it scores the prompts with
every tap and makes one compare run with --engine-noise (whose floor engine at 1 is a worker process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from conftest import REPO
from divergence_probe.cli import app
from divergence_probe.errors import ProbeError
from divergence_probe.models import get_family
from divergence_probe.spec import LoadSpec, check_family, spec_from_flat
from divergence_probe.taps import ALL_TAPS, TapKey
from test_compare_cli import assert_nothing_written, assert_one_line_error

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

TP2 = {"tensor_parallel_size": 2}

_DRIVER = """
import sys, time, torch

def main():
    import divergence_probe as dp
    from divergence_probe.runs.loading import load_run_prompts
    from divergence_probe.errors import ProbeError
    from divergence_probe.spec import spec_from_flat
    from divergence_probe.engines.vllm import tensor_parallel
    from divergence_probe.taps import ALL_TAPS

    model, prompts, out = sys.argv[1:4]
    spec = spec_from_flat("compare", model=model, prompts=prompts, device="cpu", taps="all", engine_noise=True,
                          engine_args={"tensor_parallel_size": 2})
    started = time.perf_counter()
    probe = dp.load(spec=spec.load, taps=spec.capture.taps, plan_for=spec)
    load_seconds = time.perf_counter() - started
    _, sequences = load_run_prompts(spec, probe.tokenizer, probe.source.max_model_len)
    taps = {}
    scores = probe.infer.score_batched(sequences, frozenset(ALL_TAPS),
                                       lambda pid, key, x: taps.__setitem__((pid, key.name, key.layer), x.clone()))
    run = probe.run(spec)
    run.write(out + "/run")
    try:  # a rank that raises: nothing is installed to collect
        probe.infer._rpc(tensor_parallel._collect)
        rank_error = None
    except ProbeError as e:
        rank_error = str(e)
    torch.save({"taps": taps, "scores": scores, "rank_error": rank_error, "load_seconds": load_seconds,
                "batches": [len(g) for g in probe.infer.batch_groups(sequences)]}, out + "/tp2.pt")
    probe.close()

if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, qwen3_tiny, prompts_file):
    """The TP=2 process's taps, scores and compare run (tiny Qwen3, BF16, the three shared prompts)."""
    out = tmp_path_factory.mktemp("tp2")
    (out / "driver.py").write_text(_DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(out / "driver.py"), str(qwen3_tiny), str(prompts_file), str(out)],
                          cwd=out, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(out / "tp2.pt", weights_only=False)
    result["run"], result["seconds"] = out / "run", time.perf_counter() - started
    print(f"TP=2 process: {result['seconds']:.0f} s, its engine start {result['load_seconds']:.0f} s")
    return result


@pytest.fixture(scope="module")
def tp1(tp2, vllm_probe, prompts_file):
    """The same prompts through the session's in-process engine at tensor_parallel_size 1, batched alike."""
    from divergence_probe.runs.loading import load_run_prompts

    spec = spec_from_flat("compare", model=str(vllm_probe.source.path), prompts=str(prompts_file), device="cpu")
    _, sequences = load_run_prompts(spec, vllm_probe.tokenizer, vllm_probe.source.max_model_len)
    assert [len(g) for g in vllm_probe.infer.batch_groups(sequences)] == tp2["batches"]
    taps = {}
    scores = vllm_probe.infer.score_batched(sequences, frozenset(ALL_TAPS),
                                            lambda pid, key, x: taps.__setitem__((pid, key.name, key.layer), x.clone()))
    return {"taps": taps, "scores": scores}


def _before_first_reduction(name: str, layer: int) -> bool:
    """Taps computed from the same inputs by the same GEMM rows, heads and elementwise ops at any TP size: everything
    before layer 0's o_proj, the first row-parallel GEMM (whose all-reduce adds the ranks' BF16 partial sums)."""
    return TapKey.of(name, layer) < TapKey.of("attn_out", 0)


def test_gathered_taps_equal_the_unsharded_engines(tp2, tp1):
    """Up to the first all-reduce the gathered taps are the TP=1 taps to the bit (a shard joined out of rank order,
    or a KV head twice, is not). From there, each o_proj/down_proj output rounds every rank's partial sum to BF16
    before adding them (one extra rounding, half a BF16 step of the partials, 2^-9 relative), and every later tap
    carries that through the layers: bound its relative L2 distance by 2^-6, four times the BF16 step, where a shard
    in the wrong place moves a tap by O(1). Measured on this model: at most 1.0e-2 (tiny Qwen2, mlp_out of layer 3)."""
    assert set(tp2["taps"]) == set(tp1["taps"])
    layers = get_family("qwen3").layer_taps
    exact = [k for k in tp2["taps"] if _before_first_reduction(k[1], k[2])]
    assert {name for _, name, layer in exact} == {"embed", *layers[: layers.index("attn_out")]}
    for key in sorted(tp2["taps"], key=lambda k: (k[0], TapKey.of(k[1], k[2]))):
        a, b = tp2["taps"][key], tp1["taps"][key]
        assert a.shape == b.shape and a.dtype == b.dtype, key
        if key in exact:
            assert torch.equal(a, b), key
        else:
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert rel <= 2**-6, (key, rel)


def test_the_first_all_reduce_differs_only_by_rounding_the_ranks_partial_sums(tp2, tp1, qwen3_tiny):
    """attn_out of layer 0 is o_proj of the same attention output (bitwise, above) at both sizes: at 1, one GEMM
    rounded once to BF16; at 2, each rank's half of the sum rounded to BF16, then their sum rounded again. Each of
    those roundings is at most a BF16 step (2^-8 relative, truncation included) of what it rounds, and each partial
    is at most |attn_core| @ |W_o|^T: so per element |TP2 - TP1| <= 2^-8 (|attn_core| @ |W_o|^T + |TP1| + |TP2|).
    A row-parallel tap taken from the wrong rank, or half-reduced, breaks it."""
    from safetensors.torch import load_file

    [weights] = qwen3_tiny.glob("*.safetensors")
    w = load_file(weights)["model.layers.0.self_attn.o_proj.weight"].double().abs()
    for pid in {k[0] for k in tp1["taps"]}:
        core = tp1["taps"][(pid, "attn_core", 0)].double().abs()
        one, two = (t["taps"][(pid, "attn_out", 0)].double() for t in (tp1, tp2))
        bound = 2**-8 * (core @ w.T + one.abs() + two.abs())
        assert ((two - one).abs() <= bound).all(), pid
        assert not torch.equal(one, two)  # the partial sums are rounded: the bound is not vacuous here


def test_logprobs_are_vllms_own_and_the_floor_is_the_tp_change(tp2, tp1):
    """At TP=2 the logprobs reported are vLLM's own, and the log-softmax of the logits gathered from rank 0 gives them
    to the bit (the CPU sampler runs that very float32 log-softmax). The run's parallelism floor (engine_noise.csv,
    its summary column, the largest floor of the run table) is what the TP change alone does to them: the same mean
    |Δlogp| as these scores against the session's engine at 1."""
    deltas = []
    by_id = {s.prompt_id: s for s in tp1["scores"]}
    for s in tp2["scores"]:
        recomputed = s.logits.log_softmax(-1, dtype=torch.float32).gather(-1, _targets(tp2, s))[:, 0]
        assert torch.equal(recomputed, s.logprobs), s.prompt_id
        deltas.append((s.logprobs.double() - by_id[s.prompt_id].logprobs.double()).abs())
    tp_change = torch.cat(deltas).mean().item()
    assert tp_change > 0  # a TP change moves logprobs (1.1e-3 on a tiny Qwen2: docs/numerics.md)

    noise = pd.read_csv(tp2["run"] / "engine_noise.csv")
    assert list(noise.change) == ["tensor_parallel_size 1 vs 2"]
    assert noise.mean_abs_dlogp.iloc[0] == pytest.approx(tp_change, rel=1e-9)
    summary = pd.read_csv(tp2["run"] / "summary.csv").iloc[0]
    assert summary["noise_infer_tensor_parallel_mean_abs_dlogp"] == noise.mean_abs_dlogp.iloc[0]
    from divergence_probe.numerics.tables import largest_noise_floor

    assert largest_noise_floor(summary)[0] == "noise_infer_tensor_parallel_mean_abs_dlogp"


def _targets(tp2, scores) -> torch.Tensor:
    """The token each of a prompt's logit rows predicts (prompts.jsonl of the run)."""
    rows = [json.loads(line) for line in (tp2["run"] / "prompts.jsonl").read_text().splitlines()]
    [prompt] = [r for r in rows if r["prompt_id"] == scores.prompt_id]
    return torch.tensor(prompt["token_ids"][1:])[:, None]


def test_the_manifest_records_the_tp_size_and_rerun_replays_it(tp2):
    from divergence_probe.engines.vllm.replayable import refused_engine_args
    from divergence_probe.runs.rerun import command_line
    from divergence_probe.spec import RunSpec

    manifest = json.loads((tp2["run"] / "manifest.json").read_text())
    assert manifest["load"]["engine_args"]["tensor_parallel_size"] == 2
    infer = manifest["stacks"]["infer"]["settings"]
    assert infer["tensor_parallel"]["size"] == 2 and infer["tensor_parallel"]["cpu_threads_bind"] == "0|1"
    assert infer["captured_logits_vs_reported_logprobs_max_gap"] == 0
    assert manifest["memory_plan"]["inputs"]["tensor_parallel"] == 2
    spec = RunSpec.from_dict(manifest["spec"])
    assert refused_engine_args(spec.load.engine_args) == []
    assert '{"tensor_parallel_size": 2}' in command_line(spec)


def test_a_failed_rank_is_one_line(tp2):
    """A rank that raises ends the call in one line with the rank's own message (the CLI: exit code 2)."""
    assert tp2["rank_error"] == "a vLLM tensor-parallel rank failed in collect: no capture is installed in this rank"


@pytest.mark.parametrize("flags, refused", [
    ({"graft": True}, "--graft cannot run at tensor_parallel_size 2"),
    ({"depth": True}, "--depth cannot run at tensor_parallel_size 2"),
    ({"align": "rope"}, "regions aligned in the engine .* cannot run at tensor_parallel_size 2: .* --side train"),
    ({"kind": "ablate"}, "regions aligned in the engine .* cannot run at tensor_parallel_size 2"),
    ({"kind": "ablate", "side": "train"}, None),
    ({"mode": "generate"}, "--mode generate cannot run at tensor_parallel_size 2"),
    ({"engine": "compiled"}, "--engine compiled cannot run at tensor_parallel_size 2"),
    ({"align": "rope", "side": "train"}, None),
    # a factor's settings as its flag's: the combination that runs compiled is refused before loading
    ({"kind": "ablate", "side": "train", "factor": "engine:enforce_eager=false"},
     "the combination engine:enforce_eager=false cannot run: --engine compiled cannot run at tensor_parallel_size 2"),
    ({"kind": "ablate", "side": "train", "engine": "compiled", "factor": "engine:enforce_eager=true"},
     "--engine compiled cannot run at tensor_parallel_size 2"),
])
def test_what_cannot_run_sharded_is_refused_before_loading(flags, refused):
    flags = dict(flags)
    spec = spec_from_flat(flags.pop("kind", "compare"), model="m", engine_args=TP2, **flags)
    if refused is None:
        check_family(spec, spec.load, get_family("qwen2"))
        return
    with pytest.raises(ProbeError, match=refused) as e:
        check_family(spec, spec.load, get_family("qwen2"))
    assert "\n" not in str(e.value)


def test_a_mixture_of_experts_and_rl_are_refused_at_tp_2(tmp_path):
    with pytest.raises(ProbeError, match="tensor_parallel_size > 1 is not supported for Qwen3-MoE"):
        check_family(None, LoadSpec(model="m", engine_args=TP2), get_family("qwen3_moe"))
    from divergence_probe.rl.experiment import run
    from divergence_probe.spec.rl import rl_spec

    with pytest.raises(ProbeError, match="rl cannot run at tensor_parallel_size 2"):
        run(rl_spec(engine_args=TP2, device="cpu"), tmp_path / "rl")
    assert not (tmp_path / "rl").exists()


def test_the_cli_refuses_graft_at_tp_2_in_one_line_and_writes_nothing(qwen3_tiny, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["compare", "--model", str(qwen3_tiny), "--device", "cpu", "--graft",
                                      "--engine-args", json.dumps(TP2), "--out", str(out)], catch_exceptions=False)
    assert_one_line_error(result, "--graft cannot run at tensor_parallel_size 2")
    assert_nothing_written(out)
