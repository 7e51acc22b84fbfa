"""How to lay out the tap reduction on a GPU: four layouts of metrics.diff_sums, timed on one prompt's taps.

    python3 docs/results/h200/compiled/reduction_variants.py --out docs/results/h200/reduction-variants.json   # on a CUDA machine

One prompt of the Qwen2.5-1.5B shape at 1024 tokens, its taps grouped by shape as capture.py groups them
(BF16 pairs that differ by ~1%, like the two stacks' taps). Each layout is compiled once (dynamic shapes, as
fused.py does) and timed with CUDA events after a warm-up; accuracy is the largest relative error of the four
sums against float64 sums of the same pair. Layouts (first level -> second level):
  whole rows      one row per tap: blocks of 64 summed in FP32 -> FP64 (the CPU path)
  token rows f64  one row per token of a tap, summed in FP64 -> FP64 over tokens
  token rows f32  one row per token of a tap, summed in FP32 -> FP64 over tokens
  blocks of 64    every statistic per block of 64 elements (FP32) -> FP64 over a tap's blocks
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from divergence_probe.metrics import blocks_first, row_diff_sums, merge_row_sums

# one prompt of Qwen2.5-1.5B at 1024 tokens, grouped by shape: taps per group, features. 8 taps per layer and
# embed, final_norm at the hidden size (q_rope and attn_core are 12 heads x 128 = 1536 too), k_rope (2 KV heads x
# 128), swiglu, the logits of the 1023 scored positions
GROUPS = {"hidden": (8 * 28 + 2, 1536), "k_rope": (28, 256), "swiglu": (28, 8960), "logits": (1, 151936)}
TOKENS = 1024


def whole_rows(t, r):
    return row_diff_sums(t.reshape(len(t), -1), r.reshape(len(r), -1))  # the CPU path of metrics.diff_sums


def token_rows_f64(t, r):
    return merge_row_sums(row_diff_sums(t.flatten(0, 1), r.flatten(0, 1), lambda x: x.double().sum(1)), len(t))


def token_rows_f32(t, r):
    return merge_row_sums(row_diff_sums(t.flatten(0, 1), r.flatten(0, 1), lambda x: x.sum(1).double()), len(t))


LAYOUTS = {"whole rows": whole_rows, "token rows f64": token_rows_f64, "token rows f32": token_rows_f32,
           "blocks of 64": blocks_first}  # the GPU path of metrics.diff_sums


def prompt_pairs(groups: dict[str, tuple[int, int]], tokens: int,
                 device: str = "cuda") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One prompt's tap pairs, per group: [taps, tokens, features] BF16, test = ref with ~1% noise (the
    logits group has one row less: the scored positions)."""
    g = torch.Generator(device=device).manual_seed(0)
    pairs = {}
    for name, (taps, features) in groups.items():
        rows = tokens - 1 if name == "logits" else tokens
        ref = torch.randn(taps, rows, features, device=device, generator=g).bfloat16()
        test = (ref.float() * (1 + 1e-2 * torch.randn(ref.shape, device=device, generator=g))).bfloat16()
        pairs[name] = (test, ref)
    return pairs


def time_ms(fn, iters: int) -> float:
    """Milliseconds per call of fn, by CUDA events over `iters` calls after one warm-up call (which compiles)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / iters, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    pairs = prompt_pairs(GROUPS, TOKENS)
    exact = {}
    for name, (t, r) in pairs.items():
        td, rd = t.double().flatten(1), r.double().flatten(1)
        d = td - rd
        exact[name] = torch.stack([d.abs().sum(1), (d * d).sum(1), (rd * rd).sum(1), (td * td).sum(1)], 1)
        del td, rd, d
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": TOKENS,
              "groups": {k: list(v) for k, v in GROUPS.items()}, "layouts": {}}
    for layout, fn in LAYOUTS.items():
        compiled = torch.compile(fn, dynamic=True)
        per_group, worst = {}, 0.0
        for name, (t, r) in pairs.items():
            got = compiled(t, r)
            worst = max(worst, ((got[:, [1, 3, 4, 5]] - exact[name]).abs() / exact[name].abs()).max().item())
            per_group[name] = time_ms(lambda: compiled(t, r), args.iters)
        result["layouts"][layout] = {"ms_per_group": per_group, "ms_per_prompt": round(sum(per_group.values()), 3),
                                     "max_rel_error_of_sums": worst}
        print(layout, result["layouts"][layout], flush=True)
    gb = sum(2 * t.numel() * t.element_size() for t, _ in pairs.values()) / 1e9
    result["bytes_read_per_prompt_gb"] = round(gb, 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
