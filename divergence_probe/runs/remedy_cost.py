"""What a remedy arm costs: each side's step (the trainer's forward, its forward and backward, the engine's step)
timed and its peak memory read on the loaded stacks, each side in the process that runs it (runs/remedies.py runs the
arms)."""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from ..engines.elapsed import Elapsed
from ..engines.peak import PeakMemory

SIDES = ("train_forward", "train_forward_backward", "engine_step")  # the steps whose cost is timed, per arm


@contextmanager
def _measured(stack, device: str) -> Iterator[tuple[PeakMemory, Elapsed]]:
    """Where a side's step is measured: in the stack's own process when it runs in one (an engine worker, declared in
    its capabilities: its peak memory there, and its own clock around the engine's call, so the hand-over of the
    results to this process is no part of the step), else in this one, on `device`. The peak's reset and read stay
    outside the timed step."""
    own = stack.capabilities().own_process
    with (stack.peak_memory() if own else PeakMemory(device).measuring() as peak,
          stack.step_time() if own else Elapsed(device).timing() as clock):
        yield peak, clock


def _untrained(load) -> str | None:
    """Why the trainer `load` configures cannot take a training step (its kernel set declares no backward: a backward
    through its ops raises nothing, it stops at the first one, so its time would be no step's), or None."""
    from ..engines import stack_class
    from ..spec.load import SHIPPED_KERNELS

    if load.train_kernels == SHIPPED_KERNELS or stack_class(load.train).kernel_set(load.train_kernels).backward:
        return None
    return f"--train-kernels {load.train_kernels}: its ops carry no gradients: rl refuses this set"


def _forward(view, prompts) -> None:
    view.train.score_batched(prompts)


def _forward_backward(view, prompts) -> None:
    """One right-padded batch forward with grad and the backward of its summed token logprobs: a training step's
    compute without the optimizer (whose cost no remedy changes). Gradients are dropped after."""
    import torch

    stack = view.train
    model = stack.model
    params = [p for p in model.parameters()]
    was = [p.requires_grad for p in params]
    pad = model.generation_config.pad_token_id or 0
    longest = max(len(p.token_ids) for p in prompts)
    device = params[0].device
    ids = torch.full((len(prompts), longest), pad, device=device)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, : len(p.token_ids)] = torch.tensor(p.token_ids)
        mask[row, : len(p.token_ids)] = 1
    positions = torch.arange(longest, device=device)[None].expand_as(ids)
    try:
        for p in params:
            p.requires_grad_(True)
        logits = stack.forward(ids, mask, positions)  # the Trainer protocol's training forward, as rl runs it
        chosen = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        with stack.numerics("train") as observed, observed(autocast=False):  # the forward was autocast; not this
            (chosen * mask[:, 1:]).sum().backward()
    finally:
        for p, grad in zip(params, was):
            p.grad = None
            p.requires_grad_(grad)


def _engine_step(view, prompts) -> None:
    view.infer.score(prompts, frozenset(), lambda *_: None)


STEPS = {"train_forward": _forward, "train_forward_backward": _forward_backward, "engine_step": _engine_step}


def measure_cost(view, prompts, repeats: int, steps=STEPS) -> dict:
    """Each side's step on one batch of `prompts` (a batch as each side groups them), timed `repeats` times after one
    untimed warm-up, where the side runs: {side}_s (median), {side}_spread_s (max - min over the repeats),
    {side}_peak_bytes (the largest peak above the step's start), engine_step_timed_in (`worker`: an engine in a worker
    process timed there, `process`: in this one), trains (whether the trainer can take a training step), and
    train_weights_bytes (what the trainer holds). A side the arm cannot run (the forward and backward of a kernel set
    without a backward, a sharded trainer's sides) is never run: NaN, its reason under {side}_note."""
    untrained = _untrained(view.config)
    skipped = {"train_forward_backward": untrained} if untrained else {}
    if view.config.train_tp > 1:  # its model is not in this process
        skipped = dict.fromkeys(("train_forward", "train_forward_backward"), "a sharded trainer runs in worker processes")
    row: dict = {"engine_step_timed_in": "worker" if view.infer.capabilities().own_process else "process",
                 "trains": untrained is None}
    train_device = str(next(view.train.model.parameters()).device) if view.config.train_tp == 1 else "cpu"
    for side, run_step in steps.items():
        engine = side == "engine_step"
        stack, device = (view.infer, view.settings.device) if engine else (view.train, train_device)
        group = stack.batch_groups(prompts)[0]
        if side in skipped:
            row[f"{side}_note"] = skipped[side]
            times, peaks = [float("nan")], [float("nan")]
        else:
            run_step(view, group)  # warm-up: first-call allocations and kernel selection are no step's cost
            times, peaks = [], []
            for _ in range(repeats):
                with _measured(stack, device) as (peak, clock):
                    run_step(view, group)
                times.append(clock.seconds)
                peaks.append(peak.peak)
        row[f"{side}_s"] = statistics.median(times)
        row[f"{side}_spread_s"] = max(times) - min(times)
        row[f"{side}_peak_bytes"] = max(peaks)
    row["train_weights_bytes"] = float(sum(t.numel() * t.element_size() for t in
                                           (*view.train.model.parameters(), *view.train.model.buffers()))) \
        if view.config.train_tp == 1 else float("nan")
    return row


def pooled(first: dict, last: dict) -> dict:
    """The shipped stacks' cost, measured before the arms and again after them: the median of both, the spread of
    both (so a drift of the machine over the run shows as noise, not as an arm's cost)."""
    row = {}
    for side in SIDES:
        values = [first[f"{side}_s"], last[f"{side}_s"]]
        row[f"{side}_s"] = float(np.median(values))
        row[f"{side}_spread_s"] = max(first[f"{side}_spread_s"], last[f"{side}_spread_s"],
                                      abs(values[0] - values[1]))
        row[f"{side}_peak_bytes"] = max(first[f"{side}_peak_bytes"], last[f"{side}_peak_bytes"])
    row["train_weights_bytes"] = first["train_weights_bytes"]
    row["engine_step_timed_in"] = first["engine_step_timed_in"]
    return row
