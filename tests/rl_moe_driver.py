"""Runs rl on the tiny Qwen3-MoE in its own process (rl's engine has prefix caching on): an experiment with and
without routing replay, which experts the update's forward ran with, and the weight-sync check's expert cases.
Prints one JSON object of what it saw. Arguments: model, out folder, engine (eager, the default, or compiled).

Before the run, at the checkpoint's weights, it records the routes and router logits of fixed rollouts (two generate
calls: the second's prompts come from the prefix cache) in OUT/same_tokens.pt, for test_rl_moe to compare the eager
engine's with the compiled one's on the tokens both fed. The compiled engine is built with router_logits tap points
beside the route records rl's own load gives it, so that its router logits can be read too."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

import divergence_probe.rl as rl
from divergence_probe.errors import ProbeError
from divergence_probe.engines.layouts import layout_of, lookup
from divergence_probe.engines.vllm.weights import WeightSession
from divergence_probe.models import find
from divergence_probe.rl.trainer import Trainer
from divergence_probe.engines.vllm.rollout import RolloutRecorder

model, root = sys.argv[1], Path(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "eager"
seen: dict = {}
# prompts longer than a KV block (32 tokens, the CPU backend's smallest): a group's responses share a full block of
# their prompt, so the prefix cache serves some of their rows and the recorded routes must fill those in from the
# request that computed them
prompts = root / "prompts.txt"
root.mkdir(parents=True, exist_ok=True)
prompts.write_text("Write a short list of words in lowercase letters only, one after another, about the sea, the "
                   "wind, the boats and the birds that fly over the water in the morning:\n\n"
                   "Continue this sentence with plain lowercase words and no digits or symbols at all: the old "
                   "library by the river kept its doors open late into the night because\n")
spec = rl.rl_spec(model=model, setting=("none", "routing"), steps=1, group_size=4, prompts_per_step=2,
                  max_new_tokens=8, device="cpu", reward="letters", prompts=str(prompts), audit_every=1,
                  engine_args={"block_size": 32}, engine=mode)
t0 = time.perf_counter()
if mode == "compiled":  # rl's own load (route records only), with router_logits tap points beside (docstring)
    import divergence_probe as dp

    from divergence_probe.rl.loop import load_spec

    probe = dp.load(spec=load_spec(spec), taps="router_logits", routes=True)
else:
    probe = rl.load(spec)
seen["t_load"] = time.perf_counter() - t0
seen["engine_tap_points"] = sorted(probe.settings.engine_taps)

# 0. fixed rollouts at the checkpoint's weights: routes and router logits of every fed row, by sequence and position
from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

num_layers = probe.source.num_layers
texts = [t for t in prompts.read_text().split("\n\n") if t.strip()]
prompt_ids = [tuple(probe.tokenizer(t)["input_ids"]) for t in texts]
t0 = time.perf_counter()
with probe.infer.routes_recorded(frozenset({"expert_ids", "router_logits"})) as recorder:
    outputs = []
    for call in range(2):  # the second call's prompt rows are served from the prefix cache the first one filled
        requests = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids for _ in range(2)]
        params = [SamplingParams(max_tokens=6, temperature=1.0, seed=call * 100 + k, logprobs=0, detokenize=False)
                  for k in range(len(requests))]
        outputs += probe.infer.llm.generate(requests, params, use_tqdm=False)
sequences = {out.request_id: tuple(out.prompt_token_ids) + tuple(out.outputs[0].token_ids) for out in outputs}
fixed_ids = recorder.routes(sequences, num_layers)
fixed_logits = recorder.routes(sequences, num_layers, tap="router_logits")
internal = recorder.request_ids()
torch.save({"tokens": [sequences[out.request_id] for out in outputs],
            "expert_ids": [fixed_ids[out.request_id] for out in outputs],
            "router_logits": [fixed_logits[out.request_id] for out in outputs],
            "cached_rows": [min(p for p, _, _ in recorder._rows(internal[out.request_id])) for out in outputs]},
           root / "same_tokens.pt")
seen["t_same_tokens"] = time.perf_counter() - t0

cached_rows = []
real_routes = RolloutRecorder.routes


def counting_routes(self, sequences, num_layers):  # rows each request was served from the prefix cache
    internal = self.request_ids()
    cached_rows.append(sum(min(p for p, _, _ in self._rows(internal[i])) for i in sequences))
    return real_routes(self, sequences, num_layers)


RolloutRecorder.routes = counting_routes

# 1. the experiment: one engine, the setting without and with replay; meanwhile, which experts the update's forward
# ran with (the ids each layer's experts module was called with), and the rollout's record of the engine's routes
hf = layout_of(probe.train.model, "hf")
layers = find(probe.train.model, hf.model["layers"])
received: dict[int, torch.Tensor] = {}
hooks = [find(layer, hf.layer["experts"]).register_forward_pre_hook(
    lambda m, args, i=i: received.__setitem__(i, args[1].detach().clone())) for i, layer in enumerate(layers)]
steps = []
real_rollout, real_step = rl.Loop.rollout, rl.Loop.step


def keep_rollout(self, *args):
    steps.append({"routes": (out := real_rollout(self, *args))[2]})
    return out


def keep_step(self, *args):
    row = real_step(self, *args)
    steps[-1] |= {"replay": self.replay, "metric": row["frac_response_any_flip"]}
    return row


forward = Trainer.forward


def keep_forward(self, sequences, n_prompt, *rest):
    """The update's forward: a step's first (the first step's start floors score its sequences again, one by one)."""
    out = forward(self, sequences, n_prompt, *rest)
    if "batch" not in steps[-1]:
        steps[-1] |= {"batch": (sequences, n_prompt), "received": dict(received)}
    return out


with mock.patch.object(rl.Loop, "rollout", keep_rollout), mock.patch.object(rl.Loop, "step", keep_step), \
        mock.patch.object(Trainer, "forward", keep_forward):
    t0 = time.perf_counter()
    result = rl.run(spec, root / "run", probe=probe)
    seen["t_run"] = time.perf_counter() - t0
for h in hooks:
    h.remove()
seen["settings"] = result.rows.setting.tolist()
seen["sync_tensors"] = result.rows.sync_tensors.tolist()
seen["sync_audited"] = result.rows.sync_audited.tolist()
seen["cached_rows"] = list(cached_rows)
for step in steps:
    (sequences, n_prompt), routes = step["batch"], step["routes"]
    longest = max(map(len, sequences))
    same = flipped = tokens = 0
    for b, (seq, n) in enumerate(zip(sequences, n_prompt)):
        rows = list(range(n - 1, len(seq) - 1))  # the rows whose logits score a response token
        any_set = torch.zeros(len(rows), dtype=torch.bool)
        for i in range(len(layers)):
            ran = step["received"][i].view(len(sequences), longest, -1)[b, rows]
            engine = routes[b][rows, i].long()
            same += int((ran == engine).all(dim=1).sum())
            any_set |= torch.tensor([set(a.tolist()) != set(e.tolist()) for a, e in zip(ran, engine)])
        flipped += int(any_set.sum())
        tokens += len(rows)
    seen["replay" if step["replay"] else "own"] = {"rows_layers_equal": same, "rows_layers": tokens * len(layers),
                                                   "ran_flip_frac": flipped / tokens, "metric": step["metric"]}
loop = rl.Loop(probe, spec)  # a trainer at the checkpoint, on the engine the run left with its trained weights


def error_of(fn) -> str:
    try:
        fn()
    except ProbeError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# 2. a push that skips one expert tensor (moved in the trainer): the check names the engine tensor and the trainer's
skipped = f"{hf.model['layers']}.1.{lookup('vllm', probe.train.model.config.model_type).experts.tensors['w2_weight']}"


def skip_expert():
    weights = loop.trainer.named_weights()
    with torch.no_grad():
        weights[skipped].add_(1e-2)
    session = probe.infer.weight_session  # the engine's weight sync, driven below its protocol
    session.load((n, t) for n, t in weights.items() if n != skipped)
    session.reset_cache()
    session.prove(weights)


seen["skipped_expert"] = error_of(skip_expert)


# 3. vLLM's reload alone (no re-run of the experts kernel's layout): the check names the experts
def push_without_experts_fix(self, named):
    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(named)),
                                                      "is_checkpoint_format": True})
    head = find(self.model, self.layout.model["lm_head"])
    if self.tied and head is not None:
        head.quant_method.process_weights_after_loading(head)


def reload_alone():
    probe.infer.weight_session.cache_probe.prime()
    with mock.patch.object(WeightSession, "load", push_without_experts_fix):
        loop.push_and_check()


seen["reload_alone"] = error_of(reload_alone)


# 4. (compiled) route buffers the graph did not write (zeroed before the host reads them after each step): the
# replaying step refuses the rollout's routes instead of training on them
if mode == "compiled":
    tap_points = loop.probe.infer.tap_points
    real_deliver = tap_points.deliver

    def stale(input_ids):
        for key, buffer in tap_points.buffers.items():
            if tap_points.keys[key].name == "expert_ids":
                buffer.zero_()
        real_deliver(input_ids)

    loop.replay = True
    with mock.patch.object(tap_points, "deliver", stale):
        seen["stale_routes"] = error_of(lambda: loop.step(spec.load.seed, 1))
print("RESULT " + json.dumps(seen))
