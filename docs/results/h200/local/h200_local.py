"""The grafting runs (issue 15) on one GPU: local error per op, aligned regions' local error, the depth curve, cost.

    PYTHONPATH=$HOME/site:$PWD python3 docs/results/h200/local/h200_local.py --preset qwen2.5-1.5b --out OUT
    bash docs/results/h200/local/h200_local_job.sh qwen3-1.7b          # the same, logged and packed into $OUT/PRESET-local.tgz

One process, one eager vLLM engine (grafting needs every layer tap). Under OUT/ it writes run folders made with
the public API (tokens.csv gzipped):
  graft/          compare --graft, as shipped: local.csv, local_families.csv beside layers.csv
  depth/          compare --graft --depth on the first --depth-prompts prompts: depth.csv (a partial forward per
                  layer: about L/2 full forwards per prompt)
  ablate-graft/   ablate --side both --graft: every combination's local.csv (an aligned region's seams at zero
                  local error where the GPU kernels allow; the attribution beside it)
and timings.json: load, each run, and the cost check (median of --reps interleaved `--taps all` and `--graft`
compares: the issue's target is graft <= 2x taps all). The last line printed says where everything is.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, required=True)
    add_workload_arguments(ap)
    ap.set_defaults(num_prompts=16, bootstrap=200)  # graft and ablate --graft on 16 prompts fit one lent slot
    ap.add_argument("--depth-prompts", type=int, default=8, help="prompts of the depth run (it costs ~L/2 forwards)")
    ap.add_argument("--reps", type=int, default=4, help="timed compares per setting in the cost check")
    args = ap.parse_args()

    import divergence_probe as dp
    from divergence_probe.modelzoo import make_model

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, object] = {}
    model_dir = args.models_dir / args.preset
    if not (model_dir / "config.json").exists():
        _, timings["make_model_s"] = timed(lambda: make_model(model_dir, preset=args.preset, seed=0))
    load = dp.LoadSpec(model=str(model_dir), device=args.device, engine="eager")
    probe, timings["load_s"] = timed(lambda: dp.load(spec=load))
    opts = dict(prompts=args.prompts, num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)

    def save(run, name: str) -> None:
        run.manifest["command"] = ["docs/results/h200/local/h200_local.py", "--preset", args.preset, name]
        run.write(out / name)
        gzip_tokens(out / name)
        print(f"== {name}: {out / name}", flush=True)

    _, timings["warmup_s"] = timed(lambda: probe.compare(taps="none", **opts))
    run, timings["graft_s"] = timed(lambda: probe.compare(graft=True, **opts))
    save(run, "graft")
    print(run.files()["local_families.csv"].to_string(index=False), flush=True)
    depth_opts = opts | {"num_prompts": min(args.depth_prompts, args.num_prompts or args.depth_prompts)}
    run, timings["depth_s"] = timed(lambda: probe.compare(depth=True, **depth_opts))
    save(run, "depth")
    print(run.files()["depth.csv"].to_string(index=False), flush=True)

    cost: dict[str, list[float]] = {"taps all": [], "graft": []}
    for _ in range(args.reps):
        cost["taps all"].append(timed(lambda: probe.compare(taps="all", **opts))[1])
        cost["graft"].append(timed(lambda: probe.compare(graft=True, **opts))[1])
    medians = {k: statistics.median(v) for k, v in cost.items()}
    timings["cost_check"] = {"times_s": cost, "median_s": medians,
                             "graft_over_taps_all": medians["graft"] / medians["taps all"], "target": 2.0}
    print(f"== cost: graft / taps all = {medians['graft'] / medians['taps all']:.2f}x (target <= 2x)", flush=True)
    (out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")

    run, timings["ablate_graft_s"] = timed(lambda: probe.ablate(side="both", graft=True, bootstrap=args.bootstrap,
                                                                **opts))
    save(run, "ablate-graft")
    (out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    print(f"results: {out} (graft/, depth/, ablate-graft/, timings.json); render one with "
          f"`divergence-probe report {out}/graft`", flush=True)


if __name__ == "__main__":
    main()
