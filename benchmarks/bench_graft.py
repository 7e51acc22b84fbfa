"""Benchmark `compare --graft` (and `--depth`) against an ordinary tapped compare, in one process.

    PYTHONPATH=$PWD VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python benchmarks/bench_graft.py [--reps 5]
    ... benchmarks/bench_graft.py --model CKPT --device cuda --num-prompts 59 --out g.json   # on a GPU: docs/ untouched

Target: a grafted compare costs at most 2x an ordinary `--taps all` compare (one extra op per seam,
no second forward per seam). `--depth` is measured too; it runs a partial forward per layer (about L/2 full
forwards per sequence), so it has no such target.

One `dp.load`, one warm-up call of each setting, then `--reps` rounds in which every setting runs once, in turn
(interleaved, so a slow spell of the shared machine hits all settings alike); medians. Writes its section of
docs/benchmarks.md (between the bench_graft markers) and the raw numbers to docs/benchmarks/bench_graft.json, or
only the raw numbers to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from docs_section import add_out_argument, write_section  # the one marked section of docs/benchmarks.md this benchmark owns

TARGET_RATIO = 2.0
SETTINGS = {"taps all": {}, "graft": {"graft": True}, "graft + depth": {"depth": True}}


def measure(args) -> dict:
    import torch

    import divergence_probe as dp
    from divergence_probe.models.modelzoo import make_model

    model = args.model
    if model is None:
        model = str(make_model(Path(tempfile.mkdtemp()) / "qwen3-tiny", arch="qwen3", preset="tiny", seed=0))
    from divergence_probe.versions import environment

    label = "modelzoo tiny Qwen3" if args.model is None else args.model
    load_start = os.getloadavg()[0]
    probe = dp.load(model, infer="vllm", dtype=args.dtype, device=args.device)
    env = environment(args.device)
    options = dict(num_prompts=args.num_prompts, taps="all")
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    n_tokens = 0
    for rep in range(args.reps + 1):  # rep 0: warm-up
        for name, extra in SETTINGS.items():
            if args.device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            run = probe.compare(**options, **extra)
            elapsed = time.perf_counter() - start
            n_tokens = run.summary["n_tokens"]
            if rep:
                times[name].append(elapsed)
    return {
        "model": model, "model_label": label, "num_layers": probe.source.num_layers, "dtype": args.dtype, "device": args.device,
        "num_prompts": args.num_prompts, "n_tokens": n_tokens, "reps": args.reps, "times_s": times,
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "machine": f"{env['gpu'] or env['cpu']}, {os.cpu_count()} CPUs, torch threads {env['torch_threads']}",
        "versions": env["versions"],
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},
    }


def section(result: dict) -> str:
    med = result["median_s"]
    base = med["taps all"]
    ratio = med["graft"] / base
    fastest = {name: min(t) for name, t in result["times_s"].items()}
    fast_ratio = fastest["graft"] / fastest["taps all"]
    load = result["load_average"]
    lines = [
        "## compare --graft: cost of the local error (and of --depth)",
        "",
        "Written by `benchmarks/bench_graft.py` (method: its docstring; raw numbers: "
        "`docs/benchmarks/bench_graft.json`). The machine is shared: compare ratios, not seconds.",
        "",
        f"- Machine: {result['machine']}; versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items())}",
        f"- Model: {result['model_label']} "
        f"({result['num_layers']} layers, {result['dtype']}, {result['device']}); `probe.compare(num_prompts="
        f"{result['num_prompts']}, taps='all', ...)` on `sample_prompts/` ({result['n_tokens']} scored tokens), "
        f"one warm-up call each, then {result['reps']} interleaved rounds. 1-minute load average of the machine: "
        f"{load['start']:.1f} at the start, {load['end']:.1f} at the end (on {os.cpu_count()} CPUs: other "
        "processes' load makes single calls slow at random; the fastest calls are the least disturbed).",
        "",
        "| setting | median (s) | min (s) | max (s) | / taps all |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, t in result["times_s"].items():
        lines.append(f"| {name} | {med[name]:.2f} | {min(t):.2f} | {max(t):.2f} | {med[name] / base:.2f}x |")
    verdict = "met" if ratio <= TARGET_RATIO else "not met"
    fast_verdict = "met" if fast_ratio <= TARGET_RATIO else "not met"
    lines += ["", f"**graft / taps all = {ratio:.2f}x** on medians ({verdict}), **{fast_ratio:.2f}x** on the fastest "
              f"calls ({fast_verdict}); target at most {TARGET_RATIO:g}x. "
              "`--depth` adds a partial training forward per graft point (L + 2 of them, about L/2 full forwards per "
              "sequence), so it grows with depth and has no target.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: modelzoo tiny Qwen3, built here)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--reps", type=int, default=5)
    add_out_argument(parser)
    args = parser.parse_args()
    result = measure(args)
    print(section(result))
    write_section("bench_graft", section(result), result, args.out)
    print(f"wrote {args.out or 'docs/benchmarks.md and docs/benchmarks/bench_graft.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
