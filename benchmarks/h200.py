"""The GPU lane: compare and ablate at real Qwen shapes on one CUDA GPU, with timings, in one process.

    PYTHONPATH=$HOME/site:$PWD python3 benchmarks/h200.py --preset qwen2.5-1.5b --out $OUT/qwen2.5-1.5b
    ... --part rollout --out $OUT/qwen2.5-1.5b-rollout

One process per model (one vLLM engine per process). `--part prefill` writes, under --out:
  compare/             compare with all taps (the run folder compare writes)
  ablate-both/         ablate --side both, and ablate-train/ --side train (tokens.csv dropped: too large to commit)
  timings.json         seconds for each step and the ratios the benchmark targets are stated in
`--part rollout` writes noise-prefill/ (compare --taps none --batch-invariance) and generate/
(compare --mode generate --batch-invariance, all taps) and timings.json.
`--part perf` is the performance workload: --num-prompts prompts of exactly --max-prompt-tokens tokens
(each built from the shipped sample prompts, concatenated from a different starting prompt until long enough):
first `divergence-probe compare` in a fresh process, timed from start to files (cli-compare/, cli-compare.log);
then in this process loads, compare all taps vs none (interleaved, --reps each, with host-CPU, GC and allocator
counts per run), ablate over three regions, the anatomy of the taps' cost (benchmarks/tap_anatomy.py), a host-side
profile of one tapped compare (cProfile) and a device-side one (torch.profiler table: device-profile.txt), perf.json.
The model is built with make-model (real shapes, seeded weights): real weights need a network.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer
from bench_compare import profile_tapped
from tap_anatomy import anatomy

import divergence_probe as dp
from divergence_probe.numerics.fused import backend
from divergence_probe.models.source import resolve_model
from divergence_probe.models.modelzoo import make_model
from divergence_probe.prompts import default_prompts_path, load_prompts


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


def long_prompts(tokenizer, max_model_len: int, n: int, tokens: int, path: Path) -> Path:
    """n prompts of at least `tokens` tokens as .jsonl: prompt i joins sample prompts i, i+1, ... until long enough."""
    texts = [p.text for p in load_prompts(default_prompts_path(), tokenizer, max_model_len=max_model_len)]
    with open(path, "w") as f:
        for i in range(n):
            parts, j = [], i
            while len(tokenizer("\n\n".join(parts)).input_ids) < tokens:
                parts.append(texts[j % len(texts)])
                j += 1
            f.write(json.dumps({"prompt": "\n\n".join(parts)}) + "\n")
    return path


def cold_cli_compare(model_dir: Path, prompts: Path, max_prompt_tokens: int, device: str, out: Path) -> dict:
    """What a user waits for: `divergence-probe compare` (all taps) in a fresh process, from the start of Python
    to the reports on disk: imports, both loads, compiling the tap reduction, the compare and its files."""
    command = [sys.executable, "-m", "divergence_probe", "compare", "--model", str(model_dir), "--device", device,
               "--prompts", str(prompts), "--max-prompt-tokens", str(max_prompt_tokens), "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (out.parent / "cli-compare.log").write_text(done.stdout[-4000:] + done.stderr[-8000:])
    if done.returncode == 0:
        (out / "tokens.csv").unlink()  # 65k rows: too large to commit; the summary and layers stay
    return {"wall_s": seconds, "returncode": done.returncode, "command": " ".join(command[1:])}


class CompareDiagnostics:
    """What else a timed compare did, to explain a slow one: host CPU seconds, time in Python's garbage collector,
    and CUDA caching-allocator events (a cudaMalloc/cudaFree or an out-of-memory retry stalls the host)."""

    _ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free")

    def __init__(self) -> None:
        self.gc_s, self._gc_start = 0.0, None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_s += time.perf_counter() - self._gc_start

    def _allocator(self) -> dict:
        stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        return {k: stats.get(k, 0) for k in self._ALLOCATOR}

    def measure(self, fn):
        """fn's result, its wall seconds, and what it did besides."""
        gc_before, cpu_before, alloc_before = self.gc_s, time.process_time(), self._allocator()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        result, seconds = timed(fn)
        alloc = self._allocator()
        return result, seconds, {
            "wall_s": round(seconds, 4),
            "host_cpu_s": round(time.process_time() - cpu_before, 4),
            "gc_s": round(self.gc_s - gc_before, 4),
            **{k: alloc[k] - alloc_before[k] for k in self._ALLOCATOR},
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        }


def device_profile(probe, table: Path, taps: str = "all", **compare_options) -> dict:
    """torch.profiler over one compare: device-busy time against wall time (host-bound or device-bound?),
    and the kernels that took it (full table in `table`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, wall = timed(lambda: probe.compare(taps=taps, **compare_options))
    events = prof.key_averages()
    table.write_text(events.table(sort_by="self_device_time_total", row_limit=40))
    # kernels only: an operator's self device time is the time of the kernels it launched, counted again
    device_s = sum(e.self_device_time_total for e in events if e.device_type != torch.autograd.DeviceType.CPU) / 1e6
    top = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CPU),
                 key=lambda e: -e.self_device_time_total)[:12]
    return {"wall_s": wall, "device_busy_s": device_s,
            "top_kernels_s": {e.key[:90]: e.self_device_time_total / 1e6 for e in top}}


def perf(probe, args, timings, prompts: Path) -> None:
    opts = dict(prompts=prompts, max_prompt_tokens=args.max_prompt_tokens)
    probe.compare(taps="none", **opts)  # warm-up: first-call kernel selection, allocator growth, the compile
    probe.compare(taps="all", **opts)
    diagnostics = CompareDiagnostics()
    for taps in ("all", "none", "none", "all") * (args.reps // 2):  # interleaved, so drift hits both alike
        run, seconds, seen = diagnostics.measure(lambda: probe.compare(taps=taps, **opts))
        timings.setdefault(f"compare_{taps}_s", []).append(seconds)
        timings.setdefault("compare_diagnostics", []).append({"taps": taps, **seen})
    save = lambda: (args.out / "perf.json").write_text(json.dumps(timings, indent=2) + "\n")  # noqa: E731
    save()  # (so far: a run cut short by the device's time limit still returns what it measured)
    _, timings["ablate_both_s"] = timed(lambda: probe.ablate(side="both", bootstrap=args.bootstrap, taps="all", **opts))
    save()
    tokenized = load_prompts(prompts, probe.tokenizer, max_prompt_tokens=args.max_prompt_tokens,
                             max_model_len=probe.settings.max_model_len)
    timings["anatomy_s"] = anatomy(probe, tokenized, rounds=2)
    timings["profile_tapped"] = profile_tapped(probe, **opts)
    timings["device_profile"] = device_profile(probe, args.out / "device-profile.txt", num_prompts=8, **opts)
    compare_all, compare_none = min(timings["compare_all_s"]), min(timings["compare_none_s"])
    timings |= {
        # medians: single runs on these machines vary by 10-30%, the fastest of each side is one sample each
        "taps_ratio": statistics.median(timings["compare_all_s"]) / statistics.median(timings["compare_none_s"]),
        "taps_ratio_fastest": compare_all / compare_none,
        "taps_ratio_anatomy": timings["anatomy_s"]["all"] / timings["anatomy_s"]["none"],
        "load_plus_compare_s": timings["load_s"] + compare_all,
        "ablate_ratio": (timings["load_s"] + timings["ablate_both_s"]) / (timings["load_s"] + 8 * compare_all),
        "tokens_per_compare": len(run.prompts) * args.max_prompt_tokens,
        "prompt_lengths": sorted({len(p.token_ids) for p in run.prompts}),
        "tap_reduction": backend(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "versions": probe.manifest()["environment"]["versions"],
    }
    save()
    print(json.dumps(timings, indent=2))


def add_workload_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every GPU-lane script shares: where results go, which prompts, which model and device."""
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/dp-models"))
    ap.add_argument("--device", default="cuda")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", required=True)
    add_workload_arguments(ap)
    ap.add_argument("--part", choices=("prefill", "rollout", "perf"), default="prefill")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=8, help="perf: timed compares per side (even)")
    args = ap.parse_args()
    if args.reps < 2 or args.reps % 2:
        ap.error("--reps must be an even number >= 2 (compares run in interleaved pairs)")

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.models_dir / args.preset
    timings: dict[str, float] = {}
    if not (model_dir / "config.json").exists():
        _, timings["make_model_s"] = timed(lambda: make_model(model_dir, preset=args.preset, seed=0))
    if args.part == "perf":  # before this process touches the GPU: the fresh process gets the device to itself
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = long_prompts(tokenizer, resolve_model(str(model_dir)).max_model_len, args.num_prompts,
                               args.max_prompt_tokens, args.out / "perf-prompts.jsonl")
        timings["cold_cli_compare"] = cold_cli_compare(model_dir, prompts, args.max_prompt_tokens, args.device,
                                                       args.out / "cli-compare")
        print(json.dumps(timings), flush=True)
    probe, timings["load_s"] = timed(lambda: dp.load(str(model_dir), infer="vllm", dtype="bfloat16", device=args.device))
    opts = dict(prompts=args.prompts, num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)

    if args.part == "rollout":
        return rollout(probe, args, opts, timings)
    if args.part == "perf":
        return perf(probe, args, timings, prompts)
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
