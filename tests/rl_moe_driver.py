"""Runs rl on the tiny Qwen3-MoE in its own process (rl's engine has prefix caching on): an experiment with and
without routing replay, which experts the update's forward ran with, and the weight-sync check's expert cases.
Prints one JSON object of what it saw."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

import divergence_probe.rl as rl
from divergence_probe.models import family_of, find
from divergence_probe.rl.sync import WeightSync
from divergence_probe.rl.trainer import Trainer
from divergence_probe.stacks.vllm.rollout import RolloutRecorder

model, root = sys.argv[1], Path(sys.argv[2])
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
spec = rl.RLSpec(model=model, setting=("none", "routing"), steps=1, group_size=4, prompts_per_step=2,
                 max_new_tokens=8, device="cpu", reward="letters", prompts=str(prompts), audit_every=1,
                 engine_args={"block_size": 32})
cached_rows = []
real_routes = RolloutRecorder.routes


def counting_routes(self, sequences, num_layers):  # rows each request was served from the prefix cache
    internal = self.request_ids()
    cached_rows.append(sum(min(p for p, _, _ in self._rows(internal[i])) for i in sequences))
    return real_routes(self, sequences, num_layers)


RolloutRecorder.routes = counting_routes
t0 = time.perf_counter()
probe = rl.load(spec)
seen["t_load"] = time.perf_counter() - t0

# 1. the experiment: one engine, the setting without and with replay; meanwhile, which experts the update's forward
# ran with (the ids each layer's experts module was called with), and the rollout's record of the engine's routes
family = family_of(probe.train.model)
layers = find(probe.train.model, family.hf.model["layers"])
received: dict[int, torch.Tensor] = {}
hooks = [find(layer, family.hf.layer["experts"]).register_forward_pre_hook(
    lambda m, args, i=i: received.__setitem__(i, args[1].detach().clone())) for i, layer in enumerate(layers)]
steps = []
real_rollout, real_step = rl.Loop.rollout, rl.Loop.step


def keep_rollout(self, *args):
    steps.append({"routes": (out := real_rollout(self, *args))[2]})
    return out


def keep_step(self, *args):
    row = real_step(self, *args)
    steps[-1] |= {"replay": self.replay, "received": dict(received), "metric": row["frac_response_any_flip"]}
    return row


forward = Trainer.forward


def keep_forward(self, sequences, n_prompt, *rest):
    steps[-1]["batch"] = (sequences, n_prompt)
    return forward(self, sequences, n_prompt, *rest)


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
    except rl.SyncError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# 2. a push that skips one expert tensor (moved in the trainer): the check names the engine tensor and the trainer's
skipped = f"{family.hf.model['layers']}.1.{family.engine_experts.tensors['w2_weight']}"


def skip_expert():
    weights = loop.trainer.named_weights()
    with torch.no_grad():
        weights[skipped].add_(1e-2)
    loop.sync.push((n, t) for n, t in weights.items() if n != skipped)
    loop.sync.reset_cache()
    loop.sync.verify(weights)


seen["skipped_expert"] = error_of(skip_expert)


# 3. vLLM's reload alone (no re-run of the experts kernel's layout): the check names the experts
def push_without_experts_fix(self, named):
    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(named)),
                                                      "is_checkpoint_format": True})
    head = find(self.model, self.family.vllm.model["lm_head"])
    if self.tied and head is not None:
        head.quant_method.process_weights_after_loading(head)


def reload_alone():
    loop.cache_probe.prime()
    with mock.patch.object(WeightSync, "push", push_without_experts_fix):
        loop.push_and_check()


seen["reload_alone"] = error_of(reload_alone)
print("RESULT " + json.dumps(seen))
