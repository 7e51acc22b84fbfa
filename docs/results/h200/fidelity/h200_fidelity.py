"""The fidelity runs (issue 13): the engine as deployed and the trainer with its own torch state, on one GPU.

    PYTHONPATH=$HOME/site:$PWD python3 docs/results/h200/fidelity/h200_fidelity.py --preset qwen2.5-1.5b --engine eager --out OUT
    PYTHONPATH=$HOME/site:$PWD python3 docs/results/h200/fidelity/h200_fidelity.py --preset qwen2.5-1.5b --engine compiled --out OUT
    python3 docs/results/h200/fidelity/h200_fidelity.py --preset qwen2.5-1.5b --summarize --out OUT

One process per engine mode (one vLLM engine per process). Under OUT/<engine>/ each process writes run folders
made with the public API (tokens.csv gzipped or dropped where too large to commit):
  compare/                 compare, isolated trainer (eager: all taps; compiled: logits only, layer taps are inside
                           the compiled graph)
  noise/                   compare --taps none --batch-invariance: each stack's batch-composition noise floor
  ablate-train/            ablate --side train (the engine as shipped: "align the trainer only")
  ablate-both/             eager only: ablate --side both (the engine cannot be patched once compiled)
  compare-train-inherited/ the trainer under the torch state vLLM leaves behind (what the tool did before)
  compare-train-math/      the trainer with --train-sdpa math (another SDPA kernel: the trainer's kernel floor)
and timings.json. `--summarize` reads both engines' folders and writes OUT/fidelity.json: the engine's own
eager-vs-compiled gap and the trainers' own gaps, from the logprob columns of runs on the same tokens.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))  # what follows lives in benchmarks/
from h200 import add_workload_arguments, gzip_tokens, timed  # the GPU lane's shared options, timer and packer

PRESETS = ("qwen2.5-1.5b", "qwen3-1.7b", "tiny")  # tiny: a CPU smoke test of this script


def run_engine(args) -> None:
    import torch

    import divergence_probe as dp
    from divergence_probe.modelzoo import make_model

    out = args.out / args.engine
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, object] = {}
    model_dir = args.models_dir / args.preset
    if not (model_dir / "config.json").exists():
        _, timings["make_model_s"] = timed(lambda: make_model(model_dir, preset=args.preset, seed=0))
    load = dp.LoadSpec(model=str(model_dir), device=args.device, engine=args.engine)
    probe, timings["load_s"] = timed(lambda: dp.load(spec=load))
    opts = dict(prompts=args.prompts, num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)
    taps = "all" if args.engine == "eager" else "logits"

    def save(run, name: str, tokens: str = "gzip") -> None:
        run.manifest["command"] = ["docs/results/h200/fidelity/h200_fidelity.py", "--preset", args.preset, "--engine", args.engine]
        run.write(out / name)
        if tokens == "gzip":
            gzip_tokens(out / name)
        else:
            (out / name / "tokens.csv").unlink()

    _, timings["warmup_compare_s"] = timed(lambda: probe.compare(taps="none", **opts))
    for t in ("none", taps):
        run, timings[f"compare_{t}_s"] = timed(lambda: probe.compare(taps=t, **opts))
    save(run, "compare")
    noise, timings["noise_s"] = timed(lambda: probe.compare(taps="none", batch_invariance=True, **opts))
    save(noise, "noise")
    sides = ("train", "both") if args.engine == "eager" else ("train",)
    for side in sides:
        abl, timings[f"ablate_{side}_s"] = timed(lambda: probe.ablate(side=side, taps="none", bootstrap=args.bootstrap,
                                                                      **opts))
        save(abl, f"ablate-{side}", tokens="drop")
    for name, changes in (("inherited", dict(train_state="inherited")), ("math", dict(train_sdpa="math"))):
        variant = probe.with_trainer(**changes)
        run, timings[f"compare_train_{name}_s"] = timed(lambda: variant.compare(taps="none", **opts))
        save(run, f"compare-train-{name}")
    timings["ablate_train_ratio"] = ((timings["load_s"] + timings["ablate_train_s"])
                                     / (timings["load_s"] + 8 * timings["compare_none_s"]))
    timings["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    (out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    print(json.dumps(timings, indent=2), flush=True)


def tokens(run_dir: Path) -> pd.DataFrame:
    path = run_dir / "tokens.csv.gz"
    return pd.read_csv(io.BytesIO(gzip.decompress(path.read_bytes()))) if path.exists() else pd.read_csv(run_dir / "tokens.csv")


def gap(a: pd.Series, b: pd.Series) -> dict:
    d = (a.to_numpy() - b.to_numpy())
    return {"mean_abs_dlogp": float(abs(d).mean()), "max_abs_dlogp": float(abs(d).max()), "n_tokens": int(d.size)}


def summarize(args) -> None:
    """The gaps that stand beside the mismatch: each is the same side twice, one setting changed."""
    result: dict[str, dict] = {}
    runs = {e: tokens(args.out / e / "compare") for e in ("eager", "compiled") if (args.out / e / "compare").exists()}
    for engine, base in runs.items():
        mismatch = pd.read_csv(args.out / engine / "compare" / "summary.csv").iloc[0].to_dict()
        noise = pd.read_csv(args.out / engine / "noise" / "batch_invariance.csv")
        row = {"vllm_vs_transformers": {k: mismatch[k] for k in ("mean_abs_dlogp", "max_abs_dlogp", "mean_kl")},
               "batch_noise": noise.set_index("side")[["mean_abs_dlogp", "max_abs_dlogp"]].to_dict("index")}
        for variant in ("inherited", "math"):
            other = tokens(args.out / engine / f"compare-train-{variant}")
            row[f"trainer_isolated_vs_{variant}"] = gap(base["logprob_train"], other["logprob_train"])
            summary = pd.read_csv(args.out / engine / f"compare-train-{variant}" / "summary.csv").iloc[0]
            row[f"vllm_vs_transformers_{variant}"] = {k: float(summary[k]) for k in ("mean_abs_dlogp", "mean_kl")}
        result[engine] = row
    if len(runs) == 2:
        result["engine_eager_vs_compiled"] = gap(runs["eager"]["logprob_infer"], runs["compiled"]["logprob_infer"])
        result["trainer_same_in_both_processes"] = gap(runs["eager"]["logprob_train"], runs["compiled"]["logprob_train"])
    (args.out / "fidelity.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, required=True)
    ap.add_argument("--engine", choices=("eager", "compiled"))
    ap.add_argument("--summarize", action="store_true")
    add_workload_arguments(ap)
    args = ap.parse_args()
    if args.summarize:
        return summarize(args)
    if not args.engine:
        ap.error("--engine eager|compiled (or --summarize)")
    run_engine(args)


if __name__ == "__main__":
    main()
