"""Benchmark `ablate`: three regions (8 runs) against one load plus 8 x the forward work of one compare.

    .venv/bin/python benchmarks/bench_ablate.py [--num-prompts 16] [--reps 3]
    .venv/bin/python benchmarks/bench_ablate.py --num-prompts 2 --reps 1 --out /tmp/a.json   # the CI smoke size

Target: ablate over three regions costs at most 1.3 x (one load of each model + 8 x one
compare), both measured side by side in this one process, on the tiny Qwen3 with every tap. The patches are
toggled on loaded stacks, so the ratio shows what patching, bootstrap and bookkeeping add to 8 plain runs.
Writes its section of docs/benchmarks.md (between the bench_ablate markers) and docs/benchmarks/bench_ablate.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import divergence_probe as dp  # noqa: E402
from divergence_probe.models.modelzoo import make_model  # noqa: E402

from docs_section import add_out_argument, write_section  # noqa: E402

TARGET = 1.3


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    add_out_argument(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "m", arch="qwen3", preset="tiny", seed=0)
        holder = {}
        load_s = timed(lambda: holder.setdefault("probe", dp.load(str(model), infer="vllm", device="cpu")))
        probe = holder["probe"]
        opts = dict(num_prompts=args.num_prompts, taps="all")
        probe.compare(**opts)  # warm-up
        compare_s, ablate_s = [], []
        for _ in range(args.reps):  # interleaved, so load on the shared machine hits both alike
            compare_s.append(timed(lambda: probe.compare(**opts)))
            ablate_s.append(timed(lambda: probe.ablate(bootstrap=1000, **opts)))
    compare, ablate = statistics.median(compare_s), statistics.median(ablate_s)
    ratio = (load_s + ablate) / (load_s + 8 * compare)
    raw = {"load_s": load_s, "compare_s": compare_s, "ablate_s": ablate_s, "ratio": ratio, "target": TARGET,
           "num_prompts": args.num_prompts, "torch": torch.__version__, "cpu_count": torch.get_num_threads()}
    md = f"""## ablate: three regions against 8 compares

Written by `benchmarks/bench_ablate.py` (raw numbers: `docs/benchmarks/bench_ablate.json`). One process, tiny Qwen3
(4 layers), vLLM CPU vs transformers, all taps, {args.num_prompts} sample prompts, bootstrap 1000;
{args.reps} interleaved repetitions, medians. Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}.

| step | seconds |
|---|---:|
| load both stacks (once) | {load_s:.2f} |
| one compare | {compare:.2f} |
| ablate (8 runs + attribution) | {ablate:.2f} |

**(load + ablate) / (load + 8 x compare) = {ratio:.2f}** (target at most {TARGET}: {"met" if ratio <= TARGET else "missed"}).
The ablation toggles reversible patches on the loaded stacks instead of reloading, so its cost is the 8
runs plus the Shapley/bootstrap arithmetic over per-prompt sums.
"""
    write_section("bench_ablate", md, raw, args.out)
    print(md)


if __name__ == "__main__":
    main()
