"""Qwen3-MoE under --engine compiled on CUDA, with vLLM's default CUDA graphs (branch moe-compiled): the router read
through tap points. One engine per process, loaded once for two runs: a prefill compare (prompt logprobs: piecewise
graphs) and a generate-mode compare (decode steps: full graphs). With `all`, the engine has tap points for every
capturable tap, router_logits and its routes included, and each run checks the engine's routes against its router
logits for every token and layer (RouteRecordError otherwise); with `none` it is vLLM as deployed. `summary` then
compares the two processes' engine logprobs bit for bit.

    python3 compiled_job.py run MODEL all OUT/all.json; python3 compiled_job.py run MODEL none OUT/none.json
    python3 compiled_job.py summary OUT/all.json OUT/none.json > OUT/summary.json
"""

import json
import os
import sys
import time

MODES = {"prefill": None, "generate": {"max_new_tokens": 16, "samples_per_prompt": 1}}


def run(model: str, taps: str, out: str) -> None:
    import divergence_probe as dp

    start = time.time()
    probe = dp.load(model, infer="vllm", dtype="bfloat16", device=os.environ.get("DP_JOB_DEVICE", "cuda"),
                     engine="compiled", taps=taps)
    result = {"load_s": round(time.time() - start, 1)}
    for mode, generate in MODES.items():
        start = time.time()
        r = probe.compare(taps=taps, num_prompts=int(os.environ.get("DP_JOB_PROMPTS", 16)), max_prompt_tokens=256, generate=generate)
        settings = r.manifest["stacks"]["infer"]["settings"]
        result[mode] = {
            "s": round(time.time() - start, 1),
            "tokens": r.tokens_table.drop(columns=[c for c in r.tokens_table if c not in (
                "prompt_id", "sample_id", "position", "token_id", "logprob_infer")]).values.tolist(),
            "routing": r.routing.table().to_dict("list") if r.routing is not None else None,
            "routes_checked": r.manifest["compare"].get("routing", {}).get("engine_routes_checked_token_layers"),
            "cudagraph_mode": settings["compilation"]["cudagraph_mode"],
            "tap_points": settings["engine_tap_points"],
            "experts": r.manifest["stacks"]["infer"]["implementations"].get("experts"),
            "vllm": r.manifest["stacks"]["infer"]["versions"]["vllm"],
            "mean_abs_dlogp": float(r.tokens_table.delta_logprob.abs().mean()),
        }
    json.dump(result, open(out, "w"))


def summary(tapped: str, plain: str) -> None:
    a, b = json.load(open(tapped)), json.load(open(plain))
    out = {"load_s": {"tapped": a["load_s"], "plain": b["load_s"]}}
    for mode in MODES:
        x, y = a[mode], b[mode]
        out[mode] = {k: x[k] for k in ("cudagraph_mode", "tap_points", "experts", "vllm", "routes_checked")}
        out[mode] |= {"tokens": len(x["tokens"]), "tokens_and_logprobs_bitwise_equal": x["tokens"] == y["tokens"],
                      "equal_rows": sum(p == q for p, q in zip(x["tokens"], y["tokens"])),
                      "routed_rows_per_layer": x["routing"]["tokens"],
                      "frac_topk_set_differs": x["routing"]["frac_topk_set_differs"],
                      "mean_abs_dlogp": {"tapped": x["mean_abs_dlogp"], "plain": y["mean_abs_dlogp"]},
                      "s": {"tapped": x["s"], "plain": y["s"]}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    {"run": run, "summary": summary}[sys.argv[1]](*sys.argv[2:])
