"""Every benchmark under benchmarks/ runs at its smallest size, and what it writes renders the docs' section.

Each runs as the docs run it, a script in a process of its own (vLLM's CPU backend hosts one engine per process),
with --out, so docs/ keeps the cited run. The numbers of a smoke size mean nothing; the test checks that the run
ends and that its raw numbers carry what the section in docs/benchmarks.md is made from: where a benchmark has a
renderer of its own (bench_compare.render, bench_graft.section, ...), the test renders the section from the file.
benchmarks/memory_plan.py is smoke-tested in tests/models/test_memory_plan.py. What each costs: docs/benchmarks.md's
opening paragraph (the two compiled benchmarks build three compiled engines each, most of the cost).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.engine, pytest.mark.slow]  # each starts at least one vLLM engine
# The benchmarks that build several engines each (compiled ones: three compiled builds) would take CI past its time
# budget on a fresh machine; they run with DP_ALL_BENCHMARKS=1 (docs/benchmarks.md says what each costs).
every_benchmark = pytest.mark.skipif(not os.environ.get("DP_ALL_BENCHMARKS"),
                                     reason="builds several engines; set DP_ALL_BENCHMARKS=1 to run it")


def run(script: Path, *args) -> None:
    """Run a script as the docs run it, from the repository root, in a process of its own."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, str(script), *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def raw_numbers(tmp_path: Path, script: str, *args) -> dict:
    """What benchmarks/<script> writes with --out: the raw numbers its docs section is made from."""
    out = tmp_path / "out.json"
    run(REPO / "benchmarks" / script, *args, "--out", out)
    return json.loads(out.read_text())


@pytest.fixture
def benchmark_module(monkeypatch):
    """Import a benchmark script as a module (its directory first on sys.path, as when it runs)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    return importlib.import_module


def test_bench_compare_on_the_tiny_moe_renders_its_section(tmp_path, benchmark_module):
    """The MoE arch is the one with a target of its own; the dense arch runs the same code."""
    data = raw_numbers(tmp_path, "bench_compare.py", "--plan", "tiny", "--arch", "qwen3_moe")
    assert data["model"]["arch"] == "qwen3_moe" and data["model"]["num_local_experts"] > 1
    assert set(data["overhead"]["times_s"]) == {"all", "none"} and data["summary"]["ratio"] > 0
    assert data["targets"]["max_ratio"] == benchmark_module("bench_compare").TARGET_RATIO["qwen3_moe"]
    assert "runs/route_capture.py:finish_prompt" in data["overhead"]["profile"]["cumulative_s"]
    section = benchmark_module("bench_compare").render(data)
    assert "## compare: tap overhead and peak memory (qwen3_moe)" in section and "all / none" in section


@every_benchmark
def test_bench_ablate_writes_its_ratio(tmp_path):
    raw = raw_numbers(tmp_path, "bench_ablate.py", "--num-prompts", 2, "--reps", 1)
    assert {"load_s", "compare_s", "ablate_s", "ratio", "target", "num_prompts"} <= set(raw)
    assert raw["ratio"] > 0 and len(raw["compare_s"]) == len(raw["ablate_s"]) == 1


@every_benchmark
def test_bench_graft_renders_its_section(tmp_path, benchmark_module):
    raw = raw_numbers(tmp_path, "bench_graft.py", "--num-prompts", 2, "--reps", 1)
    assert "compare --graft" in benchmark_module("bench_graft").section(raw)


def test_bench_rl_renders_its_section(tmp_path, benchmark_module):
    raw = raw_numbers(tmp_path, "bench_rl.py", "--steps", 2, "--rounds", 1, "--side", "train")
    assert "overhead" in benchmark_module("bench_rl").section(raw)


@every_benchmark
def test_bench_compiled_taps_renders_its_section(tmp_path, benchmark_module):
    raw = raw_numbers(tmp_path, "bench_compiled_taps.py", "--reps", 1, "--num-prompts", 1)
    assert "taps all / untapped engine's taps none" in benchmark_module("bench_compiled_taps").section(raw)


@every_benchmark
def test_bench_compiled_align_writes_its_ratio(tmp_path):
    raw = raw_numbers(tmp_path, "bench_compiled_align.py", "--regions", "rope", "--num-prompts", 1)
    assert {"load_s", "compare_s", "cold_load_s", "ablate_s", "build_s", "ratio", "target"} <= set(raw)
    assert raw["regions"] == "rope" and len(raw["build_s"]) >= 1


def test_the_gpu_lane_runs_its_perf_part_on_the_cpu(tmp_path):
    """benchmarks/h200.py --part perf (docs/benchmarks.md's GPU section) and the code the GPU job scripts of
    docs/results/h200/ import from it, at the tiny preset on the CPU."""
    out = tmp_path / "perf"
    run(REPO / "benchmarks" / "h200.py", "--preset", "tiny", "--device", "cpu", "--part", "perf", "--num-prompts", 2,
        "--max-prompt-tokens", 64, "--reps", 2, "--bootstrap", 10, "--models-dir", tmp_path / "models", "--out", out)
    perf = json.loads((out / "perf.json").read_text())
    assert {"load_s", "compare_all_s", "compare_none_s", "ablate_both_s", "taps_ratio", "ablate_ratio",
            "load_plus_compare_s", "cold_cli_compare", "anatomy_s"} <= set(perf)


@every_benchmark
def test_bench_processes_renders_its_section(tmp_path, benchmark_module):
    """Three engine starts (the bare vLLM process and both compares) and one more timed compare for the breakdown."""
    raw = raw_numbers(tmp_path, "bench_processes.py", "--rounds", 1, "--num-prompts", 2, "--breakdown")
    assert set(raw["times_s"]) == {"transformers", "vllm", "taps_none", "taps_all"}
    assert all(len(t) == 1 and t[0] > 0 for t in raw["times_s"].values())
    assert {"load.infer", "run.score.train.reduction.first_call", "until_written"} <= set(raw["breakdown"]["timings"])
    section = benchmark_module("bench_processes").render(raw)
    assert "## The tool against two bare processes (CPU)" in section and "none / both" in section


def test_moe_tap_cost_parses_its_command_line(tmp_path):
    """benchmarks/moe_tap_cost.py makes the numbers of docs/results/h200/moe/tap-cost/ on a GPU; here its command line
    parses, and a run with no round left after the warm-up is refused before anything loads."""
    script = REPO / "benchmarks" / "moe_tap_cost.py"
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "layers" in shown.stdout and "--device" in shown.stdout, shown.stderr
    refused = subprocess.run([sys.executable, str(script), "8", "1", str(tmp_path / "t.json")], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "at least 2" in refused.stderr and not (tmp_path / "t.json").exists()
