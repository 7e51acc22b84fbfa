"""What the GPU's tap reduction (metrics.blocks_first, compiled as fused.py compiles it) pays for reading a compiled
engine's hand-over as it is, a view of the step's tap buffers, against the same taps contiguous.

    .venv/bin/python docs/results/h200/compiled/strided_reduction.py                  # CPU, about a minute
    python3 docs/results/h200/compiled/strided_reduction.py --device cuda --out docs/results/h200/strided-reduction.json

A compiled engine keeps one tap buffer per width, `[taps, buffer rows, features]`, and hands a prompt's taps over as
the slice `[:, first row : first row + tokens]` (stacks/vllm/stack.py `_Step.split`): rows contiguous, taps a whole buffer
apart. The training side stacks its taps contiguous. Per round, the same prompt's pairs are reduced in three layouts,
in an order rotated each round: both sides views (at a different first row each round, like the prompts of a step),
the run loop's pairing (the engine's side a view, the training side contiguous), and both contiguous; reported: each
one's median, its ratio to contiguous of the medians and of each round, and the bytes read per second. The shape:
one prompt of the Qwen2.5-1.5B shape on CUDA (its three widths, 1024 tokens, buffers of 4096 rows, half of vLLM's
default batch: room for the FP32 noise they are made with), a smaller one on the CPU. The parent writes its section of docs/benchmarks.md and docs/strided_reduction.json unless --out
names another file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.fx.experimental import _config as shape_config

from divergence_probe.metrics import blocks_first

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))  # what follows lives in benchmarks/
from docs_section import write_section
from reduction_variants import prompt_pairs

# width -> (taps, features): per layer 7 taps at the hidden size (input_norm, q_proj, q_rope, attn_core, attn_out,
# post_norm, mlp_out), 3 at the KV width (k_proj, v_proj, k_rope) and 3 at the MLP's (gate_proj, up_proj, swiglu)
SHAPES = {
    "cuda": dict(layers=28, widths=(1536, 256, 8960), tokens=1024, buffer_rows=4096),
    "cpu": dict(layers=4, widths=(1536, 256, 8960), tokens=128, buffer_rows=512),
}
TAPS_PER_LAYER = (7, 3, 3)
LAYOUTS = ["views", "view and copy", "contiguous"]


def measure(device: str, rounds: int) -> dict:
    shape = SHAPES[device]
    tokens = shape["tokens"]
    # per width, the two stacks' taps of a whole step (test = ref with ~1% noise, as the stacks' taps differ)
    groups = {f"width {features}": (per_layer * shape["layers"], features)
              for per_layer, features in zip(TAPS_PER_LAYER, shape["widths"])}
    buffers = list(prompt_pairs(groups, shape["buffer_rows"], device).values())
    # as fused.py compiles the reduction: dynamic shapes, deterministic, without duck sizing
    reduce = torch.compile(lambda tests, refs: torch.cat([blocks_first(t, r) for t, r in zip(tests, refs)]),
                           dynamic=True, options={"deterministic": True})
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(tests, refs) -> tuple[float, torch.Tensor]:
        sync()
        start = time.perf_counter()
        with shape_config.patch(use_duck_shape=False):
            sums = reduce(tests, refs)
        sync()
        return time.perf_counter() - start, sums

    def pairs_at(first: int, layout: str):
        views = [(t[:, first:first + tokens], r[:, first:first + tokens]) for t, r in buffers]
        tests = [t.contiguous() if layout == "contiguous" else t for t, _ in views]
        refs = [r if layout == "views" else r.contiguous() for _, r in views]
        return tests, refs

    starts = [(k * 389) % (shape["buffer_rows"] - tokens) for k in range(rounds + 2)]  # a new first row each round
    for first in starts[:2]:  # compile every layout, at two offsets
        for layout in LAYOUTS:
            timed(*pairs_at(first, layout))
    seconds = {layout: [] for layout in LAYOUTS}
    same_sums = {layout: True for layout in LAYOUTS}
    for k, first in enumerate(starts[2:]):
        found = {}
        for layout in LAYOUTS[k % len(LAYOUTS):] + LAYOUTS[: k % len(LAYOUTS)]:
            tests, refs = pairs_at(first, layout)  # the copies are made before the clock starts
            s, found[layout] = timed(tests, refs)
            seconds[layout].append(s)
        for layout in LAYOUTS:
            same_sums[layout] &= torch.equal(found[layout], found["contiguous"])
    read = 2 * sum(t[:, :tokens].numel() * t.element_size() for t, _ in buffers)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "shape": shape, "rounds": rounds, "bytes_read": read, "seconds": seconds, "median_s": median,
        "over_contiguous": {layout: median[layout] / median["contiguous"] for layout in LAYOUTS},
        "over_contiguous_round_median": {layout: statistics.median(
            s / c for s, c in zip(seconds[layout], seconds["contiguous"])) for layout in LAYOUTS},
        "gb_per_s": {name: read / s / 1e9 for name, s in median.items()},
        "sums_equal_contiguous": same_sums,
    }


def section(r: dict) -> str:
    s = r["shape"]
    return f"""## The GPU's tap reduction on a compiled engine's hand-over: views against contiguous taps (`docs/results/h200/compiled/strided_reduction.py`)
`metrics.blocks_first` compiled as fused.py compiles it, on one prompt's taps ({s['layers']} layers of widths
{', '.join(map(str, s['widths']))}, {s['tokens']} tokens; the views are slices of buffers of {s['buffer_rows']} rows),
{r['device']}, torch {r['torch']}, {r['rounds']} rounds:

| layout | median | read | / contiguous (per-round median) | sums bitwise equal to contiguous |
|---|---|---|---|---|
""" + "".join(f"| {layout} | {r['median_s'][layout] * 1e3:.1f} ms | {r['gb_per_s'][layout]:.1f} GB/s | "
              f"{r['over_contiguous'][layout]:.2f}x ({r['over_contiguous_round_median'][layout]:.2f}x) | "
              f"{r['sums_equal_contiguous'][layout]} |\n" for layout in LAYOUTS) + """
Layouts: views, both sides slices of tap buffers; view and copy, the engine's side a slice and the training side
contiguous (what the run loop reduces); contiguous, both copies.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=tuple(SHAPES), default="cpu")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, help="write the numbers here instead of docs/ (a GPU run's results)")
    args = ap.parse_args()
    results = measure(args.device, args.rounds)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    else:
        write_section("strided_reduction", section(results), results)
    print(section(results))


if __name__ == "__main__":
    main()
