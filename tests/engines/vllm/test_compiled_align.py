"""Regions aligned in a compiled engine: one engine build per combination, and a compile cache that never serves a
graph compiled for another combination.

vLLM's CPU backend hosts one engine per process, so everything that needs an engine runs in one subprocess
(`builds`) with a compile cache root of its own, shared by its builds as a user's runs share ~/.cache/vllm:
build 1, the probe's own compiled engine (shipped); build 2, an `ablate --regions rope --side both` whose
rope combination runs on an engine built with the patch (worker process; rope, because under Inductor the shipped
RMSNorm and SwiGLU already compute what the aligned ones do on this model, docs/benchmarks.md); build 3, the shipped engine once
more (worker process, same cache root). Then the eager engines of the engine-mode noise floor: one whose regions are
patched call by call (what an ablation's --engine-noise shares between combinations), one built with rope, one for a
compare. Three compiled builds in all: the CI cost of this feature.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from divergence_probe.errors import StackError
from divergence_probe.engines.hooks import Replacement
from divergence_probe.engines.vllm.aligned import CACHE_SUBDIR, _check_compiled, cache_namespace

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

REPO = Path(__file__).resolve().parents[3]

BUILDS = r'''
import json, sys, torch
import divergence_probe as dp
from divergence_probe.prompts import load_prompts
from divergence_probe.engines.vllm.worker import WorkerStack

model, prompts_file, out = sys.argv[1:4]
result = {}
probe = dp.load(model, infer="vllm", dtype="bfloat16", device="cpu", engine="compiled")            # build 1
prompts = load_prompts(prompts_file, probe.tokenizer, max_model_len=probe.settings.max_model_len)
first = probe.infer.score(prompts, frozenset(), lambda *a: None)

run = probe.ablate(prompts=prompts_file, regions="rope", side="both", taps="logits", bootstrap=0)  # build 2
tokens = run.tokens_table
result["ablate"] = {combo: tokens[tokens.combo == combo][["logprob_infer", "logprob_train"]].values.tolist()
                    for combo in tokens.combo.unique()}
result["engine_builds"] = run.manifest["ablate"].get("engine_builds", {})
result["combo_layers"] = sorted(set(run.layers_table.tap))

with WorkerStack(probe.settings, ()) as again:                                                      # build 3
    again.load(probe.settings)
    third = again.score(prompts, frozenset(), lambda *a: None)
    result["third_cache_root"] = again.info().settings["engine_process"]["vllm_cache_root"]

from divergence_probe.engines import stack_class                                                   # eager
from divergence_probe.runs.batch_invariance import NoiseEngines
eager = stack_class("vllm").other_mode(probe.settings)
with NoiseEngines("vllm") as engines:  # one eager engine, regions patched per call
    patched = engines.score(eager, ("rope",), prompts)
    plain = engines.score(eager, (), prompts)
    result["noise_engine_builds"] = len(engines)
with WorkerStack(eager, ("rope",)) as built:                                                        # eager, rope
    built.load(eager)
    prebuilt = built.score_batched(prompts)

noise = probe.compare(prompts=prompts_file, taps="none", engine_noise=True)                         # eager
result["engine_noise"] = noise.engine_noise.to_dict("records")
result["summary"] = noise.summary
result["n_tokens"] = len(noise.tokens_table)
result["files"] = sorted(noise.files())
torch.save({"first": [s.logits for s in first], "third": [s.logits for s in third],
            "patched": [s.logits for s in patched], "plain": [s.logits for s in plain],
            "prebuilt": [s.logits for s in prebuilt]}, out + ".pt")
json.dump(result, open(out, "w"), default=str)
'''


_STARTED: dict = {}  # the builds' process once started (conftest starts it at the session's start)


def start_builds(qwen3_tiny: Path, prompts_file: Path, tmp_path_factory) -> subprocess.Popen:
    """Start the builds' process (single-threaded, like every vLLM CPU engine): conftest does this when the session
    begins, so that on the CI's two cores it runs beside the tests before this module."""
    if _STARTED:
        return _STARTED["proc"]
    folder = tmp_path_factory.mktemp("compiled-align")
    out = folder / "result.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CACHE_ROOT": str(folder / "vllm-cache")}
    with open(folder / "stderr.txt", "w") as err:  # a file, not a pipe: a full pipe would stall the process
        proc = subprocess.Popen([sys.executable, "-c", BUILDS, str(qwen3_tiny), str(prompts_file), str(out)],
                                stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, env=env)
    _STARTED.update(proc=proc, folder=folder, out=out)
    return proc


@pytest.fixture(scope="module")
def builds(qwen3_tiny, prompts_file, tmp_path_factory) -> dict:
    start_builds(qwen3_tiny, prompts_file, tmp_path_factory)  # already running when the whole suite runs
    proc, folder, out = _STARTED["proc"], _STARTED["folder"], _STARTED["out"]
    proc.wait(timeout=1500)
    assert proc.returncode == 0, (folder / "stderr.txt").read_text()[-4000:]
    return json.loads(out.read_text()) | {"_logits": torch.load(str(out) + ".pt"), "_cache": str(folder / "vllm-cache")}


def test_shipped_aligned_shipped_third_build_equals_the_first_bitwise(builds):
    logits = builds["_logits"]
    assert len(logits["first"]) == len(logits["third"]) > 0
    for a, b in zip(logits["first"], logits["third"]):
        assert torch.equal(a, b)
    assert builds["third_cache_root"] == builds["_cache"]  # the shipped engine compiles into the user's cache root


def test_the_aligned_build_compiles_the_region_and_changes_the_engine(builds):
    combos = builds["ablate"]
    shipped, aligned = torch.tensor(combos["none"]), torch.tensor(combos["rope"])
    assert shipped.shape == aligned.shape
    assert not torch.equal(shipped[:, 0], aligned[:, 0])  # the engine ran other code: its logprobs moved
    assert not torch.equal(shipped[:, 1], aligned[:, 1])  # and --side both aligned the trainer too
    build = builds["engine_builds"]["rope"]
    assert build["regions"]["rope"].startswith("compiled")
    assert build["regions_aligned"] == ["rope"]
    root = Path(build["vllm_cache_root"])  # a cache namespace of its own, inside the user's root
    assert root.parent == Path(builds["_cache"]) / CACHE_SUBDIR
    assert builds["combo_layers"] == ["logits"]


def test_engine_mode_noise_floor_is_measured_in_tool(builds):
    [row] = builds["engine_noise"]
    assert row["change"] == "engine eager vs compiled" and row["side"] == "infer"
    assert row["n_tokens"] == builds["n_tokens"]
    assert row["mean_abs_dlogp"] > 0  # a second engine in the other mode, not this run's engine scored twice
    assert builds["summary"]["noise_infer_engine_mode_mean_abs_dlogp"] == row["mean_abs_dlogp"]
    assert "engine_noise.csv" in builds["files"]


def test_one_eager_noise_engine_serves_every_region_set(builds):
    """--engine-noise in an ablation: the eager engine patched call by call computes what an eager engine built with
    the regions computes, bit for bit, and the patch takes effect; one build for all combinations."""
    logits = builds["_logits"]
    assert builds["noise_engine_builds"] == 1
    assert all(torch.equal(a, b) for a, b in zip(logits["patched"], logits["prebuilt"]))
    assert not all(torch.equal(a, b) for a, b in zip(logits["patched"], logits["plain"]))


def test_cache_namespace_per_region_set(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert cache_namespace(()) is None  # the shipped engine: the user's own root
    rope, both = cache_namespace(("rope",)), cache_namespace(("rope", "rmsnorm"))
    assert rope != both and both == cache_namespace(("rmsnorm", "rope"))
    assert Path(rope).parent == tmp_path / CACHE_SUBDIR


def test_cache_namespace_follows_the_region_source(monkeypatch, tmp_path):
    """An edited region must compile anew, not be served the graph of its previous version."""
    before = cache_namespace(("swiglu",), root=str(tmp_path))
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: real(self) + (b"# edited" if self.name == "swiglu.py" else b""))
    assert cache_namespace(("swiglu",), root=str(tmp_path)) != before
    assert cache_namespace(("rope",), root=str(tmp_path)) == cache_namespace(("rope",), root=str(tmp_path))


def test_cache_namespace_follows_the_code_a_region_borrows(monkeypatch, tmp_path):
    """residual's engine patch runs rmsnorm's norm: an edited rmsnorm.py is another graph for residual too."""
    before = {r: cache_namespace((r,), root=str(tmp_path)) for r in ("residual", "swiglu")}
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: real(self) + (b"# edited" if self.name == "rmsnorm.py" else b""))
    assert cache_namespace(("residual",), root=str(tmp_path)) != before["residual"]
    assert cache_namespace(("swiglu",), root=str(tmp_path)) == before["swiglu"]  # which borrows nothing from it


def aligned_code(x):
    return x


class _Recorder:
    def __init__(self, codes) -> None:
        self.codes = codes


class _Stack:
    model = torch.nn.Linear(1, 1)


def test_a_region_missing_from_the_compiled_graph_is_refused():
    planned = {"rope": [Replacement(object(), "_forward_method", aligned_code)]}
    code = aligned_code.__code__
    ok = _check_compiled(_Stack(), planned, _Recorder({(code.co_filename, code.co_firstlineno)}))
    assert ok["rope"].startswith("compiled")
    with pytest.raises(StackError) as e:
        _check_compiled(_Stack(), planned, _Recorder(set()))
    assert "rope" in str(e.value) and "--side train" in str(e.value) and "\n" not in str(e.value)


def test_engine_noise_builds_the_other_mode_with_the_run_s_engine_args():
    from divergence_probe.engines import stack_class
    from divergence_probe.engines.protocol import StackSettings, freeze_engine_args

    other_engine_settings = stack_class("vllm").other_mode

    args = freeze_engine_args({"max_num_seqs": 8, "compilation_config": {"mode": 2}})
    compiled = StackSettings(model_path="m", dtype=torch.bfloat16, device="cpu", engine="compiled", engine_args=args)
    eager = other_engine_settings(compiled)
    assert eager.engine == "eager" and eager.engine_kwargs() == {"max_num_seqs": 8}  # eager compiles nothing
    back = other_engine_settings(eager)
    assert back.engine == "compiled" and back.engine_kwargs() == {"max_num_seqs": 8}
    assert other_engine_settings(replace(compiled, engine="eager", engine_args=args)).engine_kwargs() == \
        compiled.engine_kwargs()  # an eager run's args go to its compiled counterpart as they are


def test_report_shows_the_engine_mode_noise_floor(tmp_path):
    import numpy as np
    import pandas as pd

    from divergence_probe.reports import write_report
    from test_report import _layers, _manifest, _summary, _tokens, _write

    rng = np.random.default_rng(1)
    tokens = _tokens(rng, 0.01)
    noise = pd.DataFrame([{"stack": "vllm", "side": "infer", "change": "engine eager vs compiled",
                           "mean_abs_dlogp": 0.00123, "max_abs_dlogp": 0.01, "mean_kl": 1e-5, "max_kl": 1e-4,
                           "n_tokens": len(tokens)}])
    run = _write(tmp_path / "run", _manifest(), {"layers": _layers(rng, 0.01), "engine_noise": noise,
                                                 "summary": pd.DataFrame([_summary(tokens, "q_rope@0")])}, tokens)
    text = write_report(run, fmt="md").read_text()
    assert "engine_noise.csv" in text and "engine eager vs compiled" in text


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_build_ahead_starts_that_many_engines_before_they_are_needed(monkeypatch, ahead):
    """`--build-ahead N`: while combination i runs, the engines of combinations i+1..i+N are building, and no later
    one (each holds memory); every engine started is closed."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from divergence_probe.runs import ablate, combination
    from divergence_probe.spec import AblateSpec, RunSpec

    started, closed, seen = [], [], {}
    monkeypatch.setattr(combination, "needs_engine_build", lambda probe, regions, side: bool(regions))

    def worker(probe, step):
        regions = tuple(step.align.regions)
        started.append(regions)
        return SimpleNamespace(close=lambda: closed.append(regions))

    @contextmanager
    def aligned_probe(probe, regions, side, worker=None):
        assert (worker is not None) == bool(regions)  # every aligned combination finds its engine started
        yield probe
        if worker is not None:
            worker.close()

    def run_compare(view, step, progress, **kw):
        seen[step.align.regions] = list(started)
        manifest = {"compare": {"tap_reduction": {}}, "stacks": {"infer": {"settings": {}}}}
        return SimpleNamespace(manifest=manifest, prompts=[])

    monkeypatch.setattr(ablate, "start_worker", worker)
    monkeypatch.setattr(combination, "aligned_probe", aligned_probe)
    monkeypatch.setattr(ablate, "run_compare", run_compare)
    spec = RunSpec(kind="ablate", ablate=AblateSpec(regions=("rope", "swiglu", "rmsnorm"), build_ahead=ahead))
    probe = SimpleNamespace(settings=SimpleNamespace(device="cuda"), config=spec.load)
    ablate.run_ablation(probe, spec)
    order = [step.align.regions for step in (ablate.combo_spec(spec, c) for c in ablate.subsets(spec.ablate.regions))]
    builds = [r for r in order if r]
    for i, regions in enumerate(order):
        expected = [r for r in order[: i + ahead + 1] if r]  # this combination's engine and the next `ahead` ones
        assert seen[regions] == expected, (i, regions)
    assert sorted(closed) == sorted(started) and len(started) == len(builds)


def test_build_ahead_on_a_gpu_needs_a_fixed_kv_cache(monkeypatch):
    from divergence_probe.spec import run as spec_module
    from divergence_probe.errors import ProbeError
    from divergence_probe.spec import AblateSpec, LoadSpec, RunSpec

    monkeypatch.setattr(spec_module, "_resolved_device", lambda device: "cuda")
    with pytest.raises(ProbeError) as e:
        RunSpec(kind="ablate", ablate=AblateSpec(build_ahead=2))
    assert "kv_cache_memory_bytes" in str(e.value) and "\n" not in str(e.value)
    RunSpec(kind="ablate", ablate=AblateSpec(build_ahead=2),
            load=LoadSpec(engine_args={"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 2 * 10**9}))
    RunSpec(kind="ablate", ablate=AblateSpec(build_ahead=0))  # nothing starts together: no memory needed
    from divergence_probe.spec import spec_from_flat  # the Python API's path: a loaded probe's load settings

    fixed = LoadSpec(engine_args={"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 2 * 10**9})
    assert spec_from_flat("ablate", load=fixed, build_ahead=2).load == fixed
    with pytest.raises(ProbeError):
        spec_from_flat("ablate", load=LoadSpec(), build_ahead=2)
    with pytest.raises(ProbeError):
        AblateSpec(build_ahead=-1)


def test_a_failed_aligned_build_removes_its_compile_cache(tmp_path, monkeypatch):
    """A build that failed (e.g. the regions never reached the graph) may have saved a graph without them; the next
    build of that region set must not load it (seen on the H200: a later run found the unpatched graph, refused)."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    from divergence_probe.engines.protocol import StackSettings
    from divergence_probe.engines.vllm.worker import WorkerStack

    settings = StackSettings(model_path="m", dtype=torch.bfloat16, device="cpu", engine="compiled")
    worker = WorkerStack(settings, ("rope",))
    worker._namespace = cache_namespace(("rope",))
    Path(worker._namespace, "torch_compile_cache").mkdir(parents=True)

    def fails(what):
        raise StackError("region rope was patched before the engine compiled, but its aligned code is not in vLLM's "
                         "compiled graph")

    monkeypatch.setattr(worker, "_answer", fails)
    with pytest.raises(StackError) as e:
        worker.wait_ready()
    assert not Path(worker._namespace).exists() and "removed" in str(e.value) and "\n" not in str(e.value)
    worker.close()


def test_a_region_outside_the_compiled_graph_runs_as_python():
    """lm_head's patch is in vLLM's eager compute_logits, never in the graph: the build says so instead of refusing."""
    planned = {"lm_head": [Replacement(object(), "apply", aligned_code)]}
    status = _check_compiled(_Stack(), planned, _Recorder(set()))
    assert status["lm_head"].startswith("patched (outside the compiled graph")
