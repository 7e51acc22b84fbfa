"""Benchmark `rl`: seconds per step at the default settings, and the loop's overhead over its own work.

    .venv/bin/python benchmarks/bench_rl.py              # 12 steps of the default spec on the built-in model
    .venv/bin/python benchmarks/bench_rl.py --steps 30

Work: rollout (vLLM sampling) + reward + update (trainer forward, backward, optimizer step). Overhead: metrics
(rl_metrics on the step's tokens) + sync (the push through vLLM's reload and the prefix-cache reset) + check
(per-tensor checksums and the stale-cache probe). Target (issue 16): overhead <= 15% of work per step on the CPU.
The first step is left out (first-call costs: oneDNN primitives, allocator growth); medians over the rest, so a
step slowed by another process on a shared machine moves the figures little. The check is also split into its two
parts (checksums, probe), timed alone after the run. The load average is recorded: on a shared machine every
wall-clock figure here is an upper bound. Writes docs/bench_rl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TARGET = 0.15
WORK = ("t_rollout", "t_reward", "t_update")
OVERHEAD = ("t_metrics", "t_sync", "t_check")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench_rl.json")
    args = parser.parse_args()

    import divergence_probe.rl as rl

    spec = rl.RLSpec(steps=args.steps, device="cpu")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        probe = rl.load(spec)
        result = rl.run(spec, Path(tmp) / "run", probe=probe)
        loop = rl.Loop(probe, spec)  # time the check's two parts alone, on the same engine
        loop.reset()
        weights = loop.trainer.named_weights()
        checksums, probes = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            loop.sync.verify(weights)
            t1 = time.perf_counter()
            loop.cache_probe.check()
            checksums.append(t1 - t0)
            probes.append(time.perf_counter() - t1)
    rows = result.rows.iloc[1:]
    median = {c: statistics.median(rows[c]) for c in (*WORK, *OVERHEAD, "t_checksums", "t_probe")}
    work = sum(statistics.median(rows[c]) for c in WORK)
    overhead = sum(statistics.median(rows[c]) for c in OVERHEAD)
    report = {
        "spec": spec.to_dict(), "steps_measured": len(rows), "cpu_count": os.cpu_count(),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "median_s": {k: round(v, 4) for k, v in median.items()},
        "s_per_step_median": round(work + overhead, 4),
        "overhead_over_work": round(overhead / work, 4),
        "overhead_over_work_per_step_median": round(statistics.median(rows.overhead_frac), 4),
        "check_parts_median_s": {"checksums": round(statistics.median(checksums), 4),
                                 "stale_cache_probe": round(statistics.median(probes), 4)},
        "target": TARGET, "meets_target": overhead / work <= TARGET,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
