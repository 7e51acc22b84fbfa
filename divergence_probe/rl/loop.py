"""The GRPO step loop: sample G responses per prompt with vLLM, reward them, update the trainer, push the weights
into the running engine, verify the push, and report one row per step.

    import divergence_probe.rl as rl
    run = rl.run(rl.RLSpec(steps=50, setting=("none", "rope")), out_dir="runs/rl")

The engine is vLLM with prefix caching on, as production rollouts run (the tool's compare engine turns it off, so rl
loads its own), eager by default or compiled (`--engine compiled`: vLLM's defaults, as RL frameworks deploy it).
The loop reaches the engine only through its RolloutEngine protocol (engines/rollout_protocol.py): rollouts are
plain sampling calls (vLLM's `LLM.generate`: no prompt logprobs, no capture hooks), the engine's logprob of each
sampled token is what the policy ratio uses, and the push and its proofs are the engine's weight sync. On a mixture
of experts the rollout also records, at the router's select_experts, the experts the engine sent every row of every
sequence to (what vLLM's enable_return_routed_experts records; engines/vllm/stack.py `routes_recorded`): by a hook in
the eager engine, and in the compiled one from the route tap points its graph (and CUDA graphs) copy into static
buffers (load builds the engine with them; compiled_taps.py), read after each step and filed by request and position
like the eager hook's rows. The update's forward compares its
own router's pick with them (`frac_response_any_flip`) and, under the `routing` setting, replays them (R3).

Between runs of an experiment (settings x seeds) the trainer goes back to the checkpoint and the checkpoint's weights
are pushed through the same sync path, so one engine serves every run. Region alignment: `align.apply` on the
trainer; on the engine (--side both) the same region patch compare and ablate use, which takes effect only in the
eager engine (a compiled engine with --side both is refused: spec/rl.py).

A step where no group has signal (every group's rewards equal: every advantage, and so the gradient, is 0) still
calls AdamW's step by default (`--no-signal-step step`), which moves the weights on the optimizer's momentum (and
weight decay, if any). That default is what RL frameworks do: TRL's GRPOTrainer runs on transformers' Trainer, whose
loop steps the optimizer for every batch (huggingface/trl#3857 shows a GRPO step logged with frac_reward_zero_std 1.0
and grad_norm 0.0 whose learning rate still advanced); verl avoids such batches only through DAPO's dynamic sampling
(`algorithm.filter_groups.enable`, off by default), which drops zero-variance groups and samples more prompts instead.
Skipping is opt-in where it exists (rasbt/reasoning-from-scratch#186 `--skip-zero-advantage-updates`, whose PR notes
that AdamW moves the weights on such steps through momentum and weight decay; PrimeIntellect-ai/prime-rl#148, an
option to ignore zero advantages). `--no-signal-step skip` skips the backward and the optimizer step, leaving the
weights and the optimizer's state as they are; `optimizer_stepped` records which happened.
"""

from __future__ import annotations

import random
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import pandas as pd
import torch

from .. import align as align_api
from ..engines.rollout_protocol import RolloutSample
from ..numerics import routing
from ..errors import NumericsError, ProbeError
from ..engines.patching import aligned
from ..regions import check_regions_exist, from_engine
from ..numerics.rl_metrics import sequence_metrics, token_metrics
from .grpo import group_advantages, policy_loss
from .reward import PROMPTS, load_reward, score
from ..spec.rl import CORRECTION_KNOB, RLSetting, RLSpec, parse_setting
from .trainer import Trainer

ENGINE_ARGS = {"enable_prefix_caching": True}
WORK = ("t_rollout", "t_reward", "t_update")  # what the loop is for
OVERHEAD = ("t_metrics", "t_sync", "t_check")  # what verifying and reporting it costs


def load(spec: RLSpec, check: Callable | None = None):
    """The loaded stacks (engine + trainer, runs/loading.py) rl runs on: vLLM (--engine) with prefix caching on, BF16
    on both sides. The prompt pool is checked against the model's context once the tokenizer is known, before either
    stack loads. `check(source)`: called first, then too (rerun: the checkpoint is the one the run folder recorded)."""
    from ..runs.loading import load_stacks

    def before_stacks(source, tokenizer):
        if check is not None:
            check(source)
        if "rl" in source.family.unsupported:  # a family whose weights rl's sync check does not know
            raise ProbeError(f"rl {source.family.unsupported['rl']}; use another model")
        for setting in spec.settings:  # routing replay on a dense model: one line, before anything loads
            check_regions_exist(source.family, parse_setting(setting).regions)
        prompt_pool(spec, tokenizer, source.max_model_len)
        if source.family.top_k_field is not None:
            check_route_recording(load_spec(spec))

    # a compiled engine of a mixture of experts records the rollout's routes at tap points in its graph
    return load_stacks(spec=load_spec(spec), before_stacks=before_stacks, routes=True)


def check_route_recording(load) -> None:
    """A mixture of experts' rollouts record the routes the engine took (for the update's routing setting and the
    routing metrics): a role the engine declares (Capabilities.records_routes). Asked of the declaration before
    anything loads, so an engine that does not play it is refused in one line, not in the first step. (A routing setting
    on a trainer that does not declare replaying them is refused with the settings: spec/align.py unaligned.)"""
    from ..engines import capabilities_of

    if not capabilities_of(load.infer, engine=load.engine, ranks=load.engine_ranks).records_routes:
        raise ProbeError(f"rl on a mixture of experts records the rollout's routes, which the {load.infer} stack "
                         f"(--engine {load.engine}, {load.engine_ranks} rank(s)) does not declare it can; use a "
                         "single-process vLLM engine or a dense model")


def load_spec(spec: RLSpec):
    """The LoadSpec of rl's probe: the run's settings, with the engine knobs its settings turn (all the same)."""
    from ..spec.knobs import applied

    return applied(replace(spec.load, engine_args={**spec.load.engine_args, **ENGINE_ARGS}), spec.engine_knobs)


def prompt_pool(spec: RLSpec, tokenizer, max_model_len: int) -> list[tuple[str, tuple[int, ...]]]:
    """(text, token ids) of every prompt a step may draw; each leaves room for --max-new-tokens."""
    if spec.prompts.prompts is not None:  # the compare command's prompt files: .txt, .jsonl (chat rendered), a folder
        from ..prompts import load_prompts

        # no context limit there: its message would name compare's --max-prompt-tokens; rl's own check is below
        prompts = load_prompts(spec.prompts.path, tokenizer, max_model_len=2**62)
        pool = [(p.source, p.text, p.token_ids) for p in prompts]
    else:
        pool = [(repr(t), t, tuple(tokenizer(t)["input_ids"])) for t in PROMPTS]
    for where, _, ids in pool:
        if not ids:
            raise ProbeError(f"--prompts: prompt {where} has no tokens; remove it")
        if len(ids) + spec.max_new_tokens > max_model_len:
            raise ProbeError(f"prompt {where} has {len(ids)} tokens, and with --max-new-tokens {spec.max_new_tokens} "
                             f"a response would run past the model's context of {max_model_len} tokens; lower "
                             "--max-new-tokens or shorten the prompt")
    return [(text, ids) for _, text, ids in pool]


@dataclass
class Loop:
    """One engine and one trainer, reused by every run of an experiment."""

    probe: object  # runs.loading.LoadedStacks, loaded with ENGINE_ARGS
    spec: RLSpec
    trainer: Trainer = field(init=False)

    def __post_init__(self) -> None:
        self.engine = self.probe.infer  # a RolloutEngine (engines/rollout_protocol.py)
        if not self.engine.prefix_caching:
            raise ProbeError("rl needs a vLLM engine with prefix caching on (as production rollouts run); load it "
                             "with rl.loop.load(spec)")
        self.tokenizer = self.probe.tokenizer
        config = self.probe.train.model.config
        self._own = self.trainer = Trainer(self.probe.train, self.spec.lr, self.spec.grad_clip)
        # a setting's other trainer precision: a training stack loaded beside the run's own, on the same engine
        self.precisions: dict[str, tuple[object, Trainer]] = {}
        self.correction = self.spec.correction  # the run's: its setting's train:correction, else --correction
        self.engine.start_weight_sync(bool(getattr(config, "tie_word_embeddings", False)),
                                      min(config.vocab_size, len(self.tokenizer)))
        self.reward = load_reward(self.spec.reward)
        self.pool = prompt_pool(self.spec, self.tokenizer, self.probe.source.max_model_len)
        eos = self.probe.train.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.moe = self.probe.source.family.top_k_field is not None  # rollouts record the engine's routes
        if self.moe:
            self.engine.check_routes_recordable()
        self.replay = False  # the run's setting replays them in the update (routing, R3)
        self.on_proven: Callable[[], None] | None = None  # run(): called when a rollout's probe proved the last push

    def reset(self) -> None:
        """Trainer and engine back to the checkpoint, through the same push and checks as every step."""
        self.trainer.reset()
        self.push_and_check(audit=self.spec.audit_every > 0)
        self.engine.prove_cache()  # alone: a loop just reset holds no unproven push (the drivers push again at once)

    def push_and_check(self, audit: bool = False) -> dict:
        """Push the trainer's weights, then prove the engine computes with them (on the device; `audit`: by sha256
        on the host too). That its prefix cache serves nothing computed before the push, the stale-cache probe proves
        in the next engine call: the next rollout carries it (or `engine.prove_cache()` scores it alone)."""
        t0 = time.perf_counter()
        weights = self.trainer.named_weights()
        t_control = self.engine.push_weights(weights)  # the probe's positive control first, then the push
        t1 = time.perf_counter()
        check = self.engine.prove_push(weights, audit=audit)
        t2 = time.perf_counter()
        # stale_probe_moved: filled in by run() once the probe of this push has been scored
        return {"sync_tensors": check.tensors, "sync_changed": check.changed, "stale_probe_moved": None,
                "sync_audited": audit,
                "t_sync": t1 - t0 - t_control, "t_check": t2 - t1 + t_control, "t_verify": t2 - t1,
                "t_probe": t_control}

    def samples(self, prompts, seed: int, step: int) -> list[RolloutSample]:
        """G samples per prompt, each with a seed of its own (fixed by run seed, step, prompt and sample)."""
        g, spec = self.spec.group_size, self.spec
        return [RolloutSample(tuple(ids), spec.max_new_tokens, spec.temperature,
                              (seed * 1_000_003 + step * 10_007 + p * g + k) % 2**31)
                for p, (_, ids) in enumerate(prompts) for k in range(g)]

    def rollout(self, prompts, seed: int, step: int):
        """G responses per prompt, sampled through the engine with a seed per sequence; the push before rides the
        call (its stale-cache probe), and once it is proven the row it belongs to is released (`on_proven`)."""
        samples = self.samples(prompts, seed, step)
        carry_probe = self.engine.push_unproven  # the push before this rollout: proven fresh by this engine call
        rolled = self.engine.rollout(samples, routes=self.moe)
        if carry_probe and self.on_proven is not None:
            self.on_proven()
        responses = [r.tokens for r in rolled]
        logprobs = [r.logprobs for r in rolled]
        routes = [r.routes for r in rolled] if self.moe else None
        return responses, logprobs, routes

    def step(self, seed: int, step: int) -> dict:
        spec, g = self.spec, self.spec.group_size
        rng = random.Random(seed * 7919 + step)
        prompts = rng.sample(self.pool, min(spec.prompts_per_step, len(self.pool)))
        t0 = time.perf_counter()
        responses, lp_engine, routes = self.rollout(prompts, seed, step)
        t1 = time.perf_counter()
        prompt_of = [prompts[i // g] for i in range(len(responses))]
        rewards = torch.tensor([score(self.reward, text, self.tokenizer.decode(list(r), skip_special_tokens=True))
                                for (text, _), r in zip(prompt_of, responses)])
        advantages = group_advantages(rewards, g)
        t2 = time.perf_counter()
        sequences = [ids + r for (_, ids), r in zip(prompt_of, responses)]
        n_prompt = [len(ids) for _, ids in prompt_of]
        lp_train, entropy, mask, routing = self.trainer.forward(sequences, n_prompt, routes, self.replay)
        lp_infer = torch.zeros_like(lp_train)
        for row, (n, lps) in enumerate(zip(n_prompt, lp_engine)):
            lp_infer[row, n - 1 : n - 1 + len(lps)] = torch.tensor(lps)
        if not torch.isfinite(lp_infer).all():  # else the update writes NaN into every trainer weight
            raise NumericsError(f"rl step {step}: the engine's logprob of {int((~torch.isfinite(lp_infer)).sum())} "
                                "sampled tokens is NaN or inf, so the engine computes non-finite logits and the update "
                                "would write NaN into every trainer weight; load the engine again (a push that did not "
                                "complete leaves uninitialized memory in a layer)")
        t_floors = time.perf_counter()
        floors = self.start_floors(prompts, seed, step, responses, lp_engine, sequences, n_prompt, routes,
                                   lp_train.detach(), mask) if step == 1 else {}
        t_floors = time.perf_counter() - t_floors  # a measurement of the start, not the loop's work or overhead
        loss, loss_stats = policy_loss(lp_train, lp_infer, advantages.to(lp_train.device), mask, spec.clip_eps,
                                       self.correction, spec.tis_cap)
        with_signal = rewards.view(-1, g).std(dim=1) > 0  # per group: not every response scored alike
        stepped = bool(with_signal.any()) or spec.no_signal_step == "step"
        # no signal: every advantage is 0, so the gradient is exactly 0; `skip` leaves the optimizer (and its
        # momentum) untouched, `step` lets AdamW move the weights on its momentum as TRL and verl do (spec's help)
        grad_norm = self.trainer.step(loss) if stepped else 0.0
        t3 = time.perf_counter()
        on = mask.bool()
        train_np, infer_np = lp_train.detach()[on].cpu().numpy(), lp_infer[on].cpu().numpy()
        seq_keys = torch.arange(len(sequences), device=mask.device)[:, None].expand_as(mask)[on].cpu().numpy()
        responses_df = pd.DataFrame({"prompt_id": seq_keys // g, "sample_id": seq_keys % g,
                                     "delta_logprob": train_np.astype(np.float64) - infer_np})
        row = {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
            "groups_with_signal": float(with_signal.float().mean()),
            "response_len_mean": float(np.mean([len(r) for r in responses])),
            "eos_frac": float(np.mean([bool(r) and r[-1] in self.eos for r in responses])),
            "entropy": float(entropy[on].mean()), "loss": float(loss.detach()), **loss_stats, "grad_norm": grad_norm,
            "optimizer_stepped": stepped,
            **token_metrics(infer_np, train_np, spec.clip_eps, spec.tis_cap),
            **sequence_metrics(responses_df, spec.clip_eps),
            **floors,
        }
        if routing is not None:
            row["frac_response_any_flip"] = response_flip_frac(*routing, mask)
        t4 = time.perf_counter()
        row |= self.push_and_check(audit=spec.audit_every > 0 and step % spec.audit_every == 0)
        row |= {"t_rollout": t1 - t0, "t_reward": t2 - t1, "t_update": t3 - t2 - t_floors, "t_metrics": t4 - t3}
        row["overhead_frac"] = sum(row[k] for k in OVERHEAD) / sum(row[k] for k in WORK)
        return row

    def trainer_for(self, arm: RLSetting) -> Trainer:
        """The trainer of a setting: the run's own, or, for another train:precision, one on a training stack loaded
        beside it (once; closed by `close`)."""
        precision = arm.value("train:precision")
        if precision is None or precision == self.spec.load.train_precision:
            return self._own
        if precision not in self.precisions:
            view = self.probe.with_trainer(train_precision=precision)
            self.precisions[precision] = (view, Trainer(view.train, self.spec.lr, self.spec.grad_clip))
        return self.precisions[precision][1]

    def close(self) -> None:
        """Release the training stacks loaded beside the run's own."""
        for view, _ in self.precisions.values():
            view.close()
        self.precisions.clear()

    def start_floors(self, prompts, seed: int, step: int, responses, lp_engine, sequences, n_prompt, routes,
                     lp_train: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """Each stack against itself, alone against batched (as compare's --batch-invariance), at the run's first
        step, on the setting's own stacks: every sample of the step rolled out again alone (its own seed draws the
        same tokens while the logits agree; compared over the tokens up to the first that differs; the prompt's KV
        comes from the prefix cache, so this moves the decode's batch), and every sequence of the step scored again
        alone by the trainer. The mismatch of the same row stands beside them."""
        alone = [r for sample in self.samples(prompts, seed, step) for r in self.engine.rollout([sample], routes=False)]
        engine_diffs = []
        for first, lps, rolled in zip(responses, lp_engine, alone):
            same = next((i for i, (a, b) in enumerate(zip(first, rolled.tokens)) if a != b),
                        min(len(first), len(rolled.tokens)))
            engine_diffs.extend(abs(a - b) for a, b in zip(lps[:same], rolled.logprobs[:same]))
        on = mask.bool()
        train_diffs = []
        with torch.no_grad():
            for row, sequence in enumerate(sequences):
                lp, _, own_mask, _ = self.trainer.forward([sequence], [n_prompt[row]],
                                                          [routes[row]] if routes is not None else None, self.replay)
                width = lp.shape[1]
                train_diffs.append((lp[own_mask.bool()] - lp_train[row, :width][on[row, :width]]).abs())
        return {"floor_engine_batch": float(np.mean(engine_diffs)) if engine_diffs else float("nan"),
                "floor_train_batch": float(torch.cat(train_diffs).double().mean())}

    def run(self, setting: str, seed: int, on_row: Callable[[dict], None]) -> None:
        """One run: reset to the checkpoint, align `setting`, `spec.steps` steps; each row goes to on_row the moment
        the stale-cache probe has proven its push (in the next step's rollout, before anything else of that step; the
        last step's alone), so a stale cache leaves no row of a step whose push it follows, and a later failure of
        the next step does not take a proven row with it. A row reaches on_row (and the progress bar) one rollout
        after its step ends."""
        arm = parse_setting(setting)
        regions = arm.regions
        self.replay = bool(from_engine(regions))  # routing: R3 in the update's forward
        self.trainer = self.trainer_for(arm)
        self.correction = arm.value(CORRECTION_KNOB) or self.spec.correction
        torch.manual_seed(seed)
        with ExitStack() as stack:
            kernels = arm.value("train:kernels")
            if kernels is not None and kernels != self.trainer.stack.kernels:
                stack.enter_context(self.trainer.stack.kernels_used(kernels))
            self.reset()
            if regions:
                stack.enter_context(align_api.apply(self.trainer.model, regions))
            if regions and self.spec.side == "both":
                stack.enter_context(aligned([self.probe.infer], regions))
            held: list[dict] = []  # the last step's row, until its push is proven

            def proven() -> None:
                if held:
                    row = held.pop()
                    row["stale_probe_moved"] = self.engine.probe_moved  # the probe of this row's own push
                    on_row(row)

            stack.callback(setattr, self, "on_proven", None)
            self.on_proven = proven
            for step in range(1, self.spec.steps + 1):
                held.append({"setting": setting, "seed": seed, "step": step, **self.step(seed, step)})
            if self.engine.push_unproven:
                self.engine.prove_cache()
                proven()



def response_flip_frac(own: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of response tokens whose row (the one whose logits score them) the trainer's router sent to another
    set of experts than the engine did, in at least one layer. own, engine: [layers, B, L, k] expert ids (any order);
    mask [B, L-1]. `own` is the router's own pick, before a replay replaces it: with routing replay on, what the
    replay hides (each layer's router sees the replayed layers before it). A tie at the k-th logit broken otherwise
    counts: the trainer does run other experts there."""
    differs = routing.ids_differ(engine, own).any(dim=0)  # [B, L]: in some layer
    on = mask.bool()
    return float(differs[:, :-1][on].float().mean()) if on.any() else 0.0
