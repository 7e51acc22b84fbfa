"""The GPU lane: compare and ablate at real Qwen shapes on one CUDA GPU, with timings, in one process.

    PYTHONPATH=$HOME/site:$PWD python3 benchmarks/h200.py --preset qwen2.5-1.5b --out $OUT/qwen2.5-1.5b
    ... --part rollout --out $OUT/qwen2.5-1.5b-rollout

One process per model (one vLLM engine per process). `--part prefill` writes, under --out:
  compare/             compare with all taps (the run folder compare writes)
  ablate-both/         ablate --side both, and ablate-train/ --side train (tokens.csv dropped: too large to commit)
  timings.json         seconds for each step and the ratios the benchmark targets are stated in
`--part rollout` writes noise-prefill/ (compare --taps none --batch-invariance) and generate/
(compare --mode generate --batch-invariance, all taps) and timings.json.
The model is built with make-model (real shapes, seeded weights): real weights need a network.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import time
from pathlib import Path

import torch

import divergence_probe as dp
from divergence_probe.modelzoo import make_model


def timed(fn):
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return result, time.perf_counter() - start


def gzip_tokens(run_dir: Path) -> None:
    tokens_csv = run_dir / "tokens.csv"
    with open(tokens_csv, "rb") as src, open(tokens_csv.with_suffix(".csv.gz"), "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as dst:  # mtime=0: same data, same bytes
            shutil.copyfileobj(src, dst)
    tokens_csv.unlink()


def rollout(probe, args, opts, timings) -> None:
    noise, timings["noise_prefill_s"] = timed(lambda: probe.compare(taps="none", batch_invariance=True, **opts))
    noise.write(args.out / "noise-prefill")
    gzip_tokens(args.out / "noise-prefill")
    gen = dict(max_new_tokens=args.max_new_tokens, samples_per_prompt=1, temperature=1.0)
    run, timings["generate_s"] = timed(lambda: probe.compare(taps="all", batch_invariance=True, generate=gen, **opts))
    run.write(args.out / "generate")
    gzip_tokens(args.out / "generate")
    timings["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    (args.out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    print(json.dumps(timings, indent=2))
    print(json.dumps(run.summary, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/dp-models"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--part", choices=("prefill", "rollout"), default="prefill")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    model_dir = args.models_dir / args.preset
    timings: dict[str, float] = {}
    if not (model_dir / "config.json").exists():
        _, timings["make_model_s"] = timed(lambda: make_model(model_dir, preset=args.preset, seed=0))
    probe, timings["load_s"] = timed(lambda: dp.load(str(model_dir), infer="vllm", dtype="bfloat16", device=args.device))
    opts = dict(prompts=args.prompts, num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)

    if args.part == "rollout":
        return rollout(probe, args, opts, timings)
    probe.compare(taps="none", **opts)  # warm-up: first-call kernel selection and allocator growth
    runs = {}
    for taps in ("all", "none", "all", "none"):  # interleaved, so drift hits both alike
        run, seconds = timed(lambda: probe.compare(taps=taps, **opts))
        timings.setdefault(f"compare_{taps}_s", []).append(seconds)
        runs[taps] = run
    runs["all"].write(args.out / "compare")
    gzip_tokens(args.out / "compare")

    for side in ("both", "train"):
        abl, timings[f"ablate_{side}_s"] = timed(lambda: probe.ablate(side=side, bootstrap=args.bootstrap, taps="all", **opts))
        abl.write(args.out / f"ablate-{side}")
        (args.out / f"ablate-{side}" / "tokens.csv").unlink()

    compare_all = min(timings["compare_all_s"])
    compare_none = min(timings["compare_none_s"])
    timings["taps_ratio"] = compare_all / compare_none
    timings["compare_wall_incl_loads_s"] = timings["load_s"] + compare_all
    timings["ablate_ratio"] = (timings["load_s"] + timings["ablate_both_s"]) / (timings["load_s"] + 8 * compare_all)
    timings["tokens"] = len(runs["all"].tokens)
    timings["prompts"] = len(runs["all"].prompts)
    timings["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    (args.out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    print(json.dumps(timings, indent=2))


if __name__ == "__main__":
    main()
