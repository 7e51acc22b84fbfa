"""What inductor's deterministic mode costs the tap reduction on a GPU, and whether the default mode is reproducible.

    python3 docs/results/h200/qwen2.5-1.5b-perf/reduction_modes.py --out docs/results/h200/qwen2.5-1.5b-perf/reduction-modes.json

One prompt's taps of the Qwen2.5-1.5B shape at 1024 tokens, grouped as capture.py groups them
(reduction_variants.GROUPS), reduced the way compare reduces them
(`fused.diff_sums_of_groups`: every group in one compiled call), compiled in inductor's default mode (kernel
configurations timed at the first launch, the fastest kept) and in its deterministic mode (chosen without timing).
Each mode runs in two fresh processes, each with its own empty inductor cache, so each process compiles and
(default mode) times configurations on its own, as two runs of the tool on two fresh machines would. Reported per
process: milliseconds per prompt (all groups in one call, CUDA events over --iters calls after a warm-up), each
group alone, and the SHA-256 of the sums: equal hashes within a mode mean equal bits across processes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("default", "deterministic")


def child(mode: str, iters: int) -> dict:
    import torch

    from divergence_probe.fused import diff_sums_of_groups
    from reduction_variants import GROUPS, TOKENS, prompt_pairs, time_ms

    tests, refs = map(list, zip(*prompt_pairs(GROUPS, TOKENS).values()))
    options = {"deterministic": True} if mode == "deterministic" else {}
    together = torch.compile(diff_sums_of_groups, dynamic=True, options=options)
    sums = together(tests, refs)
    result = {"mode": mode, "ms_per_prompt": time_ms(lambda: together(tests, refs), iters),
              "sums_sha256": hashlib.sha256(sums.cpu().numpy().tobytes()).hexdigest()[:16], "ms_per_group_alone": {}}
    for name, test, ref in zip(GROUPS, tests, refs):
        alone = torch.compile(diff_sums_of_groups, dynamic=True, options=options)
        result["ms_per_group_alone"][name] = time_ms(lambda: alone([test], [ref]), iters)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--child", choices=MODES)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.iters)))
        return
    if args.out is None:
        ap.error("--out is required")
    runs = []
    for mode in MODES:
        for _ in range(2):
            with tempfile.TemporaryDirectory() as cache:  # a cold inductor cache: this process picks its own configs
                env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache + "/triton"}
                done = subprocess.run([sys.executable, __file__, "--child", mode, "--iters", str(args.iters)],
                                      env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(runs[-1], flush=True)
    import torch

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
