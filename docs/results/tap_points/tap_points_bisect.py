"""Which compiled-engine tap point changes the engine's numerics: bisect the tap set, one engine build per step.

    PYTHONPATH=$PWD:$PWD/benchmarks VLLM_ENABLE_V1_MULTIPROCESSING=0 python docs/results/tap_points/tap_points_bisect.py \
        --out docs/results/tap_points_bisect.json

The tap points of a compiled engine are meant to hand out tensors the graph writes anyway, so that its logprobs stay
bitwise those of the engine without them; which tensors a graph writes is Inductor's choice per model and shape, and
on the CPU build one batch of a tiny model came out different with every capturable tap built in
(docs/design/taps_under_compile.md). Only the taps asked for at load become tap points, so an engine built for a
subset shows whether that subset changes the graph. Each build runs in a process of its own (vLLM's CPU backend hosts
one engine per process) and scores one fixed batch: the first 4 shipped prompts cut to 96 tokens each (the batch of
docs/results/h200/compiled/h200_cgtaps.py). The search halves the set that changes the logprobs while one half alone still does, and
reports the smallest such set it reaches (a set whose halves are each harmless is reported as it is: an interaction).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BATCH_PROMPTS, BATCH_TOKENS = 4, 96


def score(model: str, taps: str) -> None:
    """Child: build the compiled engine with tap points for `taps` (or none), print the batch's prompt logprobs."""
    import divergence_probe as dp
    from divergence_probe.prompts import default_prompts_path, load_prompts

    probe = dp.load(model, device="cpu", engine="compiled", taps=taps or None)
    prompts = load_prompts(default_prompts_path(), probe.tokenizer, max_model_len=probe.settings.max_model_len)
    batch = [dataclasses.replace(p, token_ids=p.token_ids[:BATCH_TOKENS]) for p in prompts[:BATCH_PROMPTS]]
    scores = probe.infer.score(batch, frozenset(), lambda *a: None)
    print(json.dumps([s.logprobs.float().tolist() for s in scores]))


def run(model: str, taps: frozenset[str]) -> tuple[list, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", model, "--taps", ",".join(sorted(taps))],
                          capture_output=True, text=True, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    if proc.returncode:
        raise SystemExit(f"engine build for {sorted(taps)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), time.perf_counter() - start


def equal_tokens(a: list, b: list) -> tuple[int, int]:
    pairs = [(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb)]
    return sum(x == y for x, y in pairs), len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: make_model tiny Qwen3, seed 0)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--taps", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        score(args.child, args.taps)
        return
    from divergence_probe.modelzoo import make_model
    from divergence_probe.stacks.vllm.compiled_taps import NEUTRAL

    tiny = Path("/tmp/dp-models/tiny")
    if args.model is None and not (tiny / "config.json").exists():
        make_model(tiny, preset="tiny", seed=0)
    model = args.model or str(tiny)
    plain, _ = run(model, frozenset())
    steps = []

    def changes(taps: frozenset[str]) -> bool:
        logprobs, seconds = run(model, taps)
        equal, total = equal_tokens(logprobs, plain)
        steps.append({"taps": sorted(taps), "equal": equal, "of": total, "build_and_score_s": round(seconds, 1)})
        print(json.dumps(steps[-1]), flush=True)
        return equal != total

    current = frozenset(NEUTRAL)
    found = changes(current)
    while found and len(current) > 1:
        names = sorted(current)
        first, second = frozenset(names[: len(names) // 2]), frozenset(names[len(names) // 2:])
        if changes(first):
            current = first
        elif changes(second):
            current = second
        else:
            break  # neither half alone: an interaction of the two
    result = {"model": model, "batch": f"first {BATCH_PROMPTS} shipped prompts, {BATCH_TOKENS} tokens each",
              "all_taps_change_logprobs": steps[0]["equal"] != steps[0]["of"],
              "smallest_set_found": sorted(current) if found else [], "steps": steps}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
