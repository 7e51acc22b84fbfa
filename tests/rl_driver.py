"""Runs the rl loop in its own process (an engine with prefix caching on cannot share the test session's engine):
the CLI end to end, then the Python API with deliberate breakages. Prints one JSON object of what it saw."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pandas as pd
import torch

import divergence_probe
import divergence_probe.rl as rl
from divergence_probe.cli import app
from divergence_probe.errors import ProbeError
from divergence_probe.engines.vllm.weights import WeightSession

root = Path(sys.argv[1])
small = ["--steps", "2", "--group-size", "4", "--prompts-per-step", "2", "--max-new-tokens", "8", "--device", "cpu"]
seen: dict = {}

# 1. the CLI: an experiment of two settings (one engine, weights reset between runs), then its report
code = app(["rl", *small, "--steps", "1", "--setting", "none", "--setting", "rope", "--out", str(root / "cli"), "--report"],
           standalone_mode=False)
seen["cli_exit"] = code or 0

# 2. the API on the same engine: rows on disk as each step's push is proven; weights change; checksums pass after every push
spec = rl.rl_spec(steps=2, group_size=4, prompts_per_step=2, max_new_tokens=8, device="cpu", audit_every=2)
probe = rl.load(spec)
on_disk = []
result = rl.run(spec, root / "api", lambda row, done, total: on_disk.append(
    (done, len((root / "api" / "rl.csv").read_text().splitlines()) - 1)), probe=probe)
seen["rows_on_disk_after_each_step"] = on_disk
seen["sync_tensors"] = result.rows.sync_tensors.tolist()
seen["sync_changed"] = result.rows.sync_changed.tolist()
seen["sync_audited"] = result.rows.sync_audited.tolist()


# 2b. rerun of the CLI's folder, on this engine (dp.load answers with it, after running rerun's checks of the
# checkpoint): the same rows as the first run, every column but the timings (t_*, and overhead_frac, their ratio)
def loaded(spec, before_stacks, routes):
    before_stacks(probe.source, probe.tokenizer)
    return probe


with mock.patch.object(divergence_probe, "load", loaded):
    seen["rerun_exit"] = app(["rerun", str(root / "cli"), "--out", str(root / "rerun")], standalone_mode=False) or 0
first, again = (pd.read_csv(root / name / "rl.csv") for name in ("cli", "rerun"))
seen["rerun_rows"] = len(again)
timings = [c for c in first if c.startswith("t_") or c == "overhead_frac"]
seen["rerun_differs"] = sorted(c for c in first.drop(columns=timings) if not first[c].equals(again.get(c)))
seen["rerun_spec_same"] = json.loads((root / "rerun" / "manifest.json").read_text())["spec"] == json.loads(
    (root / "cli" / "manifest.json").read_text())["spec"]
loop = rl.Loop(probe, spec)  # a fresh trainer (the checkpoint) on the same engine
initial = {n: t.clone() for n, t in loop.trainer.named_weights().items()}
loop.step(seed=0, step=1)  # one update and a verified push
after = loop.trainer.named_weights()
seen["weights_changed"] = sorted(n for n in after if not torch.equal(after[n], initial[n]))


def error_of(fn) -> str:
    try:
        fn()
    except rl.SyncError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# 3. a push that skips one tensor: the checksums name it
def skip_up_proj():
    loop.step(seed=0, step=2)  # the weights move again
    weights = loop.trainer.named_weights()
    session = probe.infer.weight_session  # the engine's weight sync, driven below its protocol
    session.load((n, t) for n, t in weights.items() if n != "model.layers.1.mlp.up_proj.weight")
    session.reset_cache()
    session.prove(weights)


seen["skipped_tensor"] = error_of(skip_up_proj)
# That push left the fused gate_up_proj half-loaded: vLLM's layerwise reload materializes a layer it did not get every
# tensor of with torch.empty and loads the parts it got, so up_proj's rows hold uninitialized memory (at times NaN).
# A rollout on it writes NaN into the engine's logprobs (then, through the loss, into the trainer's weights) and into
# KV blocks, whose stale slots later requests read after every reset and push: the sections below then failed at
# random. Push every tensor again, before any engine call.
weights = loop.trainer.named_weights()
probe.infer.weight_session.load(weights.items())
probe.infer.weight_session.reset_cache()
seen["restored_after_skip"] = error_of(lambda: probe.infer.weight_session.prove(weights))


# 4. the tied head without its own reprocessing (vLLM's reload alone): the checksums name lm_head
def push_without_head_fix(self, named):
    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(named)),
                                                      "is_checkpoint_format": True})


def tied_head():  # every tensor pushed again (layer 1's up_proj too), but the head left as vLLM's reload leaves it
    probe.infer.weight_session.cache_probe.prime()  # 3's reset dropped the probe's blocks: cache them again for the
    # positive control
    with mock.patch.object(WeightSession, "load", push_without_head_fix):
        loop.step(seed=0, step=3)


seen["tied_head_unfixed"] = error_of(tied_head)


def head_is_stale(model) -> bool:
    """Whether the engine's head GEMM still computes with an old embedding after the unfixed push: its output on a few
    rows of the identity (one nonzero product per output: exact) against the live, tied embedding's. Platform
    dependent: a CPU GEMM that packs a private copy of the weight (vLLM's AMX path) keeps the old one; one that reads
    the weight in place (oneDNN on CPUs without AMX) follows the reload."""
    head, embedding = model.lm_head, model.model.embed_tokens.weight
    rows = torch.eye(embedding.shape[1], dtype=embedding.dtype, device=embedding.device)[:8]
    return not torch.equal(head.quant_method.apply(head, rows, None), torch.nn.functional.linear(rows, embedding))


seen["tied_head_stale"] = head_is_stale(probe.infer.model)

# 5. the prefix cache not reset after step 2's push: the probe riding step 3's rollout fails, step 1's row is kept
# (step 2's push never proven: no row; with 2 steps the run's closing check alone would catch it, so 3 steps)
calls = {"n": 0}
real_reset = WeightSession.reset_cache


def reset_once(self):
    calls["n"] += 1
    if calls["n"] <= 2:  # the reset to the checkpoint and step 1's push
        real_reset(self)


with mock.patch.object(WeightSession, "reset_cache", reset_once):
    seen["stale_cache"] = error_of(lambda: rl.run(replace(spec, steps=3), root / "stale", probe=probe))
rows_file = root / "stale" / "rl.csv"
seen["stale_rows"] = len(rows_file.read_text().splitlines()) - 1 if rows_file.exists() else 0
seen["stale_manifest"] = (root / "stale" / "manifest.json").exists()

# 6. the positive control: the probe's blocks gone from the cache before a push (here: a reset before it), so a
# missing reset after the push could not be seen; the push is refused before anything is pushed
loop = rl.Loop(probe, spec)
loop.reset()
probe.infer.weight_session.reset_cache()
seen["control_uncached"] = error_of(loop.push_and_check)

# 7. a step where no group has signal (a constant reward), after a step with signal (AdamW has momentum): `step`
# moves the weights on the momentum, `skip` leaves them bitwise as they are
for mode in ("step", "skip"):
    loop = rl.Loop(probe, replace(spec, no_signal_step=mode))
    loop.reset()
    first = loop.step(seed=0, step=1)
    loop.reward = lambda prompt, response: 1.0
    before = {n: t.clone() for n, t in loop.trainer.named_weights().items()}
    second = loop.step(seed=0, step=2)
    after = loop.trainer.named_weights()
    seen[f"no_signal_{mode}"] = {
        "first_signal": first["groups_with_signal"], "first_stepped": first["optimizer_stepped"],
        "second_signal": second["groups_with_signal"], "second_stepped": second["optimizer_stepped"],
        "changed": sorted(n for n in after if not torch.equal(after[n], before[n])),
        "sync_changed": second["sync_changed"]}

# 8. a NaN among the engine's logprobs (what a rollout on a layer left uninitialized gives): refused before the update
real_rollout = rl.Loop.rollout


def nan_rollout(self, prompts, seed, step):
    responses, logprobs, routes = real_rollout(self, prompts, seed, step)
    logprobs[0][0] = float("nan")
    return responses, logprobs, routes


loop.spec = replace(loop.spec, no_signal_step="step")  # an update runs whatever the rewards
before = {n: t.clone() for n, t in loop.trainer.named_weights().items()}
with mock.patch.object(rl.Loop, "rollout", nan_rollout):
    try:
        loop.step(seed=0, step=3)
        seen["nan_logprob"] = "no error"
    except ProbeError as e:
        seen["nan_logprob"] = f"{type(e).__name__}: {e}"
seen["nan_logprob_weights_kept"] = all(torch.equal(t, before[n]) for n, t in loop.trainer.named_weights().items())

# 9. deployment knobs as settings of one experiment on this engine: the update's correction and another trainer
# precision (a training stack loaded beside the run's own); each run's first row holds its noise floors, and the
# engine's floor compares the samples rolled out alone (here moved by a known 0.01 on every logprob) with the step's own
knobs = rl.rl_spec(steps=1, group_size=4, prompts_per_step=2, max_new_tokens=8, device="cpu",
                   setting=("train:correction=tis", "rope,train:precision=amp"))
precisions: list = []
real_trainer_for = rl.Loop.trainer_for


def trainer_for(self, arm):
    trainer = real_trainer_for(self, arm)
    precisions.append(trainer.stack.settings.train_precision)
    return trainer


real_engine_rollout = type(probe.infer).rollout


def shifted_halves(self, samples, routes=False):
    rolled = real_engine_rollout(self, samples, routes=routes)
    if len(samples) == 1:  # a sample of the floor, rolled out alone
        rolled = [replace(r, logprobs=tuple(lp + 0.01 for lp in r.logprobs)) for r in rolled]
    return rolled


with mock.patch.object(rl.Loop, "trainer_for", trainer_for):
    knob_run = rl.run(knobs, root / "knobs", probe=probe)
seen["knob_settings"] = knob_run.summary.setting.tolist()
seen["knob_precisions"] = precisions
seen["knob_correction_weight"] = knob_run.rows.correction_weight_mean.tolist()
seen["knob_floors"] = knob_run.rows[["floor_engine_batch", "floor_train_batch"]].values.tolist()
with mock.patch.object(type(probe.infer), "rollout", shifted_halves):
    shifted = rl.run(replace(knobs, setting=()), root / "floors", probe=probe)
seen["shifted_engine_floor"] = float(shifted.rows.floor_engine_batch.iloc[0])
print("RESULT " + json.dumps(seen))
