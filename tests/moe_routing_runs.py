"""The MoE routing runs of tests/numerics/test_moe_routing.py, on one vLLM engine in one process (vLLM's CPU backend hosts one
engine per process, and the pytest process's engine is the dense tiny Qwen3).

    python tests/moe_routing_runs.py MODEL OUT

Each run is written under OUT/<name>; the shipped run also grafts (--graft --depth), generate_r3 too (--graft).
Beside them, evidence the tests check independently of the tool's own routing code paths: every router-logit tap
of both stacks, the engine's post_norm (the router's input) and both stacks' expert ids (the engine's through a sink of
this script, the trainer's from a forward hook of this script on each transformers router, its third output)
(OUT/<name>/taps.pt), and, for the replay runs, the expert ids and weights the trainer's experts were called with and the routes the engine
handed over (OUT/<name>/replay.pt).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch

import divergence_probe as dp
from divergence_probe.runs.route_capture import RouteCapture

PROMPTS = {"num_prompts": 12, "max_prompt_tokens": 128}  # enough tokens that some routes flip on the tiny MoE


def _experts_calls(model) -> tuple[list, dict]:
    """Forward hooks on every transformers MoE layer's experts, recording the (ids, weights) they were called with."""
    calls: dict[int, list] = defaultdict(list)
    handles = [layer.mlp.experts.register_forward_hook(
        lambda m, args, out, i=i: calls[i].append((args[1].clone(), args[2].clone())))
        for i, layer in enumerate(model.model.layers)]
    return handles, calls


def _routes_handed() -> tuple[dict, callable]:
    """RouteCapture.routes wrapped: every (sequence, layer) route it hands to the trainer, recorded."""
    handed: dict[tuple[int, int], tuple] = {}
    original = RouteCapture.routes

    def routes(self, key, layer):
        ids, weights = original(self, key, layer)
        handed[(key, layer)] = (ids.clone(), weights.clone())
        return ids, weights

    RouteCapture.routes = routes
    return handed, lambda: setattr(RouteCapture, "routes", original)


def _router_taps(probe, name: str, out: Path) -> None:
    """Both stacks' router logits of the run's prompts, captured through a sink of this script and batched as compare
    batches them: the engine's steps of --batch-tokens, the trainer's one prompt per forward."""
    from divergence_probe.runs.loading import load_run_prompts
    from divergence_probe.spec import spec_from_flat

    spec = spec_from_flat("compare", load=probe.config, **PROMPTS)
    _, prompts = load_run_prompts(spec, probe.tokenizer, probe.settings.max_model_len)
    taps: dict = {}
    post_norm: dict = {}  # (prompt, layer) -> the engine's router input

    ids: dict = {}  # (side, prompt, layer) -> the expert ids its router returned

    def keep(side):
        def sink(pid, key, x):
            if key.name == "post_norm":
                post_norm[(pid, key.layer)] = x.clone()
            elif key.name == "expert_ids":
                ids[(side, pid, key.layer)] = x.clone()
            else:
                taps[(side, pid, key.layer)] = x.clone()
        return sink

    probe.infer.score_batched(prompts, frozenset({"router_logits", "post_norm", "expert_ids"}), keep("infer"))
    running = []
    hooks = [layer.mlp.gate.register_forward_hook(  # transformers' router returns (logits, weights, ids)
        lambda m, args, out, i=i: ids.__setitem__(("train", running[-1], i), out[2].clone()))
        for i, layer in enumerate(probe.train.model.model.layers)]
    try:
        for prompt in prompts:
            running.append(prompt.prompt_id)
            probe.train.score([prompt], frozenset({"router_logits"}), keep("train"))
    finally:
        for hook in hooks:
            hook.remove()
    torch.save({"taps": taps, "post_norm": post_norm, "ids": ids,
                "lengths": {p.prompt_id: len(p.token_ids) for p in prompts}}, out / name / "taps.pt")


def main(model: str, out: str) -> None:
    out = Path(out)
    probe = dp.load(model, infer="vllm", dtype="bfloat16", device="cpu")
    probe.compare(taps="all", batch_invariance=True, graft=True, depth=True, **PROMPTS).write(out / "shipped")
    _router_taps(probe, "shipped", out)
    for name, replay in (("r3", "ids"), ("ids_weights", "ids+weights")):
        handed, restore = _routes_handed()
        handles, calls = _experts_calls(probe.train.model)
        try:
            probe.compare(taps="all", align="routing", routing_replay=replay, **PROMPTS).write(out / name)
        finally:
            restore()
            for h in handles:
                h.remove()
        torch.save({"handed": handed, "calls": dict(calls)}, out / name / "replay.pt")
    probe.compare(taps="all", align="routing", mode="generate", max_new_tokens=8, num_prompts=3,
                  max_prompt_tokens=32, graft=True).write(out / "generate_r3")
    probe.ablate(taps="all", regions="rope,routing", bootstrap=0, **PROMPTS).write(out / "ablate")
    probe.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
