"""What the compiled engine's tap op costs the host per call, and what one call per layer instead of one per tap would
save (a lead from the H200 tap-cost runs: steps above the CUDA-graph sizes call the op's Python impl for every tap).

    .venv/bin/python docs/results/h200/compiled/tap_op_calls.py     # about a minute on the CPU

One compiled function stands in for a model's layers: LAYERS x TAPS elementwise ops on small [ROWS, WIDTH] tensors, so
the host's work dominates. Four versions, each timed per forward (median of REPS after warm-up):
- `untapped`: the ops alone;
- `one call per tap`: `dp::tap` (stacks/vllm/compiled_taps.py) after every op, as the engine's tap points call it;
- `one call per layer`: an op of the same kind taking the layer's TAPS tensors as a list, whose impl does the same
  per-tensor work (it is defined here only: the engine does not have it);
- `the copies alone`: the impl's per-tensor work (checks and the copy into the static buffer) called from plain Python,
  as many times, outside any graph.
Per tap: (version - untapped) / (LAYERS x TAPS). The dispatcher's share of a call is the per-call cost less the copies'.
The parent writes its section of docs/benchmarks.md and docs/tap_op_calls.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))  # what follows lives in benchmarks/
from docs_section import write_section

LAYERS, TAPS, ROWS, WIDTH = 28, 13, 8, 64  # a Qwen2.5-1.5B step's tap points: 28 layers x 13 taps


def _per_forward(fn, x, reps: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(reps: int) -> dict:
    from divergence_probe.stacks.vllm import compiled_taps

    compiled_taps.register_op()
    lib = torch.library.Library("dp_bench", "DEF")
    lib.define("tap_layer(Tensor[] xs, int[] keys) -> ()")

    def tap_layer(xs, keys):
        for x, key in zip(xs, keys):
            compiled_taps._impl(x, key)

    lib.impl("tap_layer", tap_layer, "CompositeExplicitAutograd")
    torch.library.register_fake("dp_bench::tap_layer", lambda xs, keys: None, lib=lib)
    compiled_taps.mark_effectful("dp_bench::tap_layer", lib)
    names = compiled_taps.NEUTRAL[:TAPS]
    keys = [[compiled_taps._key(name, layer) for name in names] for layer in range(LAYERS)]
    compiled_taps.make_buffers({key: WIDTH for layer in keys for key in layer}, ROWS, torch.float32, "cpu")

    def untapped(x):
        for _ in range(LAYERS * TAPS):
            x = x * 1.001
        return x

    def per_tap(x):
        for layer in keys:
            for key in layer:
                x = x * 1.001
                torch.ops.dp.tap(x, key)
        return x

    def per_layer(x):
        for layer in keys:
            outs = []
            for _ in layer:
                x = x * 1.001
                outs.append(x)
            torch.ops.dp_bench.tap_layer(outs, layer)
        return x

    x = torch.randn(ROWS, WIDTH)
    seconds = {}
    with torch._inductor.config.patch(force_disable_caches=True):
        for name, fn in (("untapped", untapped), ("one call per tap", per_tap), ("one call per layer", per_layer)):
            seconds[name] = _per_forward(torch.compile(fn, fullgraph=True), x, reps)
    flat = [key for layer in keys for key in layer]
    seconds["the copies alone"] = _per_forward(lambda x: [compiled_taps._impl(x, key) for key in flat], x, reps)
    calls = LAYERS * TAPS
    per_tap_us = {name: (s - seconds["untapped"]) * 1e6 / calls for name, s in seconds.items() if name != "untapped"}
    per_tap_us["the copies alone"] = seconds["the copies alone"] * 1e6 / calls
    return {"layers": LAYERS, "taps": TAPS, "rows": ROWS, "width": WIDTH, "reps": reps,
            "torch": torch.__version__, "per_forward_ms": {k: round(v * 1e3, 3) for k, v in seconds.items()},
            "per_tap_us": {k: round(v, 2) for k, v in per_tap_us.items()}}


def section(r: dict) -> str:
    us, ms = r["per_tap_us"], r["per_forward_ms"]
    rows = "\n".join(f"| {name} | {ms[name]} | {us[name] if name in us else '-'} |" for name in ms)
    saved = us["one call per tap"] - us["one call per layer"]
    return f"""## The tap op's host cost per call (`docs/results/h200/compiled/tap_op_calls.py`, CPU)
{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {r['torch']}. A compiled stand-in for one engine step's
{r['layers']} x {r['taps']} tap points, on [{r['rows']}, {r['width']}] FP32 tensors so that the host's work dominates;
medians of {r['reps']} forwards. Raw numbers: `tap_op_calls.json`.

| version | ms per forward | us per tap |
|---|---|---|
{rows}

One call per layer instead of one per tap would save {saved:.2f} us per tap, {saved * r['layers'] * r['taps'] / 1e3:.2f} ms
per step of {r['layers'] * r['taps']} tap points; the impl's own per-tensor work (the copies alone) is
{us['the copies alone']:.2f} us of a call's {us['one call per tap']:.2f} us."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    results = measure(ap.parse_args().reps)
    write_section("tap_op_calls", section(results), results)
    print(results)


if __name__ == "__main__":
    main()
