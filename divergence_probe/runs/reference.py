"""The reference arm (--reference float64|float32): the run's checkpoint in transformers at that precision, run on
the very token ids both stacks ran, under the same capture, so that each stack's taps and logprobs can be measured
against a value closer to exact arithmetic (numerics/reference.py turns the sums into columns and the verdict).

The reference runs as a third stack beside the two a run compares. It runs each inference batch's sequences when the
run loop hands them over (`add_sequences`, before the training stack runs them: a transformers capture swaps the
attention function in a registry shared by every model of the process, so two captures cannot be open at once), and
keeps their taps until the training stack has run each sequence; then both stacks' taps of that sequence are measured
against the reference's and everything of the sequence is dropped. So memory holds one inference batch of reference
taps, in the reference's precision, beside what the run holds anyway.

The reference is transformers' own modeling code with eager attention (a plain matmul and softmax: no kernel choice
in float64), the weights upcast exactly from the checkpoint, on the training stack's device, with no region aligned
(regions patch the stacks' own models, never this one) and the trainer's isolated torch numerics state.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np
import pandas as pd
import torch

from ..engines import get_stack
from ..environment import resolve_train_device
from ..errors import DeviceMemoryError, StackError
from ..models.size import gib
from ..numerics.graft_reading import GRAFT_TAPS, seam_families
from ..numerics.reference import PRECISIONS, SUMS, error_sums, ref_logprobs, reference_bytes
from ..taps import Tap, TapKey, each_tap, expected_taps

ATTENTION = "eager"  # the reference's attention: transformers' plain matmul-softmax-matmul
# the reference's experts (a mixture's): transformers' loop over the experts hit, each a plain matmul, where its
# default grouped matmul is a kernel choice of its own and takes no float64
EXPERTS = "eager"


@dataclass
class ReferenceResult:
    """What the reference arm measured in one run: per sequence and tap the SUMS (`sums`: columns prompt_id, layer,
    tap and SUMS), and per scored token, in the order the run scored them, the reference's logprob and the floor's
    |logprob - logprob_ref| (the reference's logits rounded once to the run's dtype)."""

    precision: str
    sums: pd.DataFrame
    logprob_ref: np.ndarray
    floor: np.ndarray
    manifest: dict
    local: pd.DataFrame | None = None  # the local reading's sums per sequence and seam (`seams`), as `sums`


class ReferenceArm:
    """The reference stack, loaded once for a run (an ablation shares it between its combinations)."""

    def __init__(self, probe, precision: str) -> None:
        self.precision = precision
        self.run_dtype = probe.settings.dtype
        settings = replace(probe.settings, device=resolve_train_device(probe.config.train_device, probe.config.device),
                           dtype=PRECISIONS[precision],
                           train_attn=ATTENTION, train_experts=EXPERTS, train_sdpa="auto", train_precision="bf16",
                           train_kernels="torch", train_tp=1)
        if probe.memory_plan is not None:  # what is free now, with the stacks loaded (one, under alternate)
            from ..models.size import device_memory
            from .memory import longest_sequence

            i, batch_tokens = probe.memory_plan.inputs, probe.settings.batch_tokens
            check_fits(i.model, precision, batch_tokens, longest_sequence(i, batch_tokens),
                       device_memory(settings.device)[0], settings.device, "beside the stacks loaded now")
        self.stack = get_stack(probe.config.train)  # the trainer's own stack, in the reference's precision
        self.stack.load(settings)

    def manifest(self) -> dict:
        """The manifest's `reference`: its precision, device and kernels, and what it is measured as."""
        return {"precision": self.precision, "device": self.stack.settings.device, "attention": ATTENTION,
                "experts": EXPERTS,
                "stack": vars(self.stack.info()),
                "floor": f"the reference rounded once to {str(self.run_dtype).removeprefix('torch.')}",
                "measure": "taps: rel_l2 of each stack against the reference; tokens: |logprob - logprob_ref|"}

    def close(self) -> None:
        self.stack.close()


@contextmanager
def reference_arm(probe, precision: str | None, arm: ReferenceArm | None = None) -> Iterator[ReferenceArm | None]:
    """The run's reference arm: `arm` when the caller shares one, else one loaded for the block (None without
    --reference)."""
    if precision is None or arm is not None:
        yield arm
        return
    arm = ReferenceArm(probe, precision)
    try:
        yield arm
    finally:
        arm.close()


class ReferenceCapture:
    """The run's capture (park/pair/add_sequences/finish_prompt, which it passes on) with the reference arm beside it:
    each sequence's inference and training taps of the run's `taps` are measured against the reference's before the
    inner capture pairs and drops them (the accumulated reading).

    The local reading: each stack that can run its ops on captured inputs (Capabilities.grafts, as --graft uses the
    trainer) runs every seam's op on the reference's inputs of that seam, rounded to the run's dtype, and its output
    is measured against the reference's output of the same op. Identical inputs on both sides, so what remains is
    each stack's own op: which op rounds worse, where the accumulated reading says where the paths part. It needs
    every tap of the reference; a stack that cannot replay (a vLLM engine) has no local error (NaN), and a mixture of
    experts none at all (its experts' seam reads the engine's routes, which the reference does not make)."""

    def __init__(self, inner, arm: ReferenceArm, probe, taps: frozenset[str]) -> None:
        layer_taps, layers = probe.source.family.layer_taps, probe.source.num_layers
        self.inner, self.arm, self.expected = inner, arm, expected_taps(taps, layers, layer_taps)
        self.families = seam_families(layer_taps)
        dense = probe.source.family.top_k_field is None
        self.replays = {side: stack for side, stack in (("infer", probe.infer), ("train", probe.train))
                        if dense and stack.capabilities().grafts}
        self.seams = expected_taps(frozenset(self.families), layers, layer_taps) if self.replays else []
        self.taps = taps | GRAFT_TAPS if self.replays else taps
        self._wanted = frozenset(self.expected)
        self._infer: dict[int, dict[TapKey, torch.Tensor]] = defaultdict(dict)
        self._train: dict[int, dict[TapKey, torch.Tensor]] = defaultdict(dict)
        self._ref: dict[int, dict[TapKey, torch.Tensor]] = defaultdict(dict)
        self._ref_scores: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._prompt_of: dict[int, int] = {}
        self._sums: list[tuple[int, torch.Tensor]] = []  # (prompt, [taps, SUMS]) per finished sequence
        self._logprobs: list[tuple[torch.Tensor, torch.Tensor]] = []  # per finished sequence: exact, floor
        self._local: list[tuple[int, torch.Tensor]] = []  # (prompt, [seams, SUMS]) per finished sequence

    def park(self, key: int, tap: Tap, x: torch.Tensor) -> None:
        for k, t in each_tap(tap, x):
            if k in self._wanted:
                self._infer[key][k] = t
        self.inner.park(key, tap, x)

    def park_route(self, key: int, tap: TapKey, x: torch.Tensor) -> None:
        self.inner.park_route(key, tap, x)

    def pair(self, key: int, tap: TapKey, x: torch.Tensor) -> None:
        if tap in self._wanted:
            self._train[key][tap] = x
        self.inner.pair(key, tap, x)

    def add_sequences(self, sequences) -> None:
        """The reference runs the inference batch's sequences, the rows each one's engine fed kept of its taps."""
        self.inner.add_sequences(sequences)
        if any(seq.prompt.prompt_id != seq.key for seq in sequences):  # the reference files its taps by prompt id
            raise StackError("a scored sequence's prompt id is not its key; report this as a bug")
        by_key = {seq.key: seq for seq in sequences}
        self._prompt_of.update({seq.key: seq.prompt_id for seq in sequences})

        def sink(key: int, tap: TapKey, x: torch.Tensor) -> None:  # the rows the engine fed, as the stacks' taps
            self._ref[key][tap] = x[: by_key[key].fed]

        def scored(scores) -> None:
            ids = torch.tensor(by_key[scores.prompt_id].prompt.token_ids[1:], device=scores.logits.device)
            self._ref_scores[scores.prompt_id] = ref_logprobs(scores.logits, ids, self.arm.run_dtype)

        self.arm.stack.score([seq.prompt for seq in sequences], self.taps, sink, on_scored=scored)

    def finish_prompt(self, key: int) -> None:
        infer, train, ref = self._infer.pop(key, {}), self._train.pop(key, {}), self._ref.pop(key, {})
        prompt = self._prompt_of.pop(key)
        rows = []
        for tap in self.expected:
            if tap not in infer or tap not in train or tap not in ref:
                side = "inference" if tap not in infer else "training" if tap not in train else "reference"
                raise StackError(f"tap {tap.label} of sequence {key} is missing on the {side} side of the "
                                 "reference's comparison; report this as a bug")
            rows.append(error_sums(infer[tap], train[tap], ref[tap], self.arm.run_dtype))
        if rows:
            self._sums.append((prompt, torch.stack(rows)))
        if self.seams:
            self._local.append((prompt, self._local_sums(ref)))
        self._logprobs.append(self._ref_scores.pop(key))
        self.inner.finish_prompt(key)

    def _local_sums(self, ref: dict[TapKey, torch.Tensor]) -> torch.Tensor:
        """[seams, SUMS]: each replaying stack's op on the reference's inputs against the reference's output (NaN
        for a side that cannot replay)."""
        dtype = self.arm.run_dtype
        inputs = {tap: x.to(dtype) for tap, x in ref.items()}
        replayed = {side: stack.replay(inputs) for side, stack in self.replays.items()}
        rows = []
        for seam in self.seams:
            exact = ref[seam]
            sides = [replayed[side][seam] if side in replayed else torch.full_like(exact, math.nan)
                     for side in ("infer", "train")]
            rows.append(error_sums(*sides, exact, dtype))
        return torch.stack(rows)

    def result(self) -> ReferenceResult:
        """Everything measured, read back from the device once."""
        records = []
        for prompt, sums in self._sums:
            for tap, values in zip(self.expected, sums.cpu().tolist()):
                records.append((prompt, tap.layer, tap.name, *values))
        sums = pd.DataFrame.from_records(records, columns=["prompt_id", "layer", "tap", *SUMS])
        local = None
        if self.seams:
            local = pd.DataFrame.from_records(
                [(prompt, tap.layer, tap.name, *values) for prompt, sums in self._local
                 for tap, values in zip(self.seams, sums.cpu().tolist())],
                columns=["prompt_id", "layer", "tap", *SUMS])
        exact = [e.cpu().numpy() for e, _ in self._logprobs]
        floor = [np.abs(f.cpu().numpy() - e) for e, (_, f) in zip(exact, self._logprobs)]
        manifest = self.arm.manifest() | {"local": {
            "reading": "each stack's op on the reference's inputs of each seam, rounded to the run's dtype "
                       "(reference_local.csv)", "stacks": sorted(self.replays)} if self.seams else {
            "reading": "not measured: neither stack replays its ops on captured inputs, or a mixture of experts"}}
        return ReferenceResult(self.arm.precision, sums, np.concatenate(exact) if exact else np.zeros(0),
                               np.concatenate(floor) if floor else np.zeros(0), manifest, local)


# ---------------------------------------------------------------------------------------------------- planning
def check_fits(size, precision: str | None, batch_tokens: int, longest: int, free: int, device: str,
               where: str) -> None:
    """Refuse --reference in one line, before it loads, when it does not fit in `free` bytes of `device` (`where`
    says beside what), scoring batches of `batch_tokens` whose longest sequence is `longest` tokens: float64 that does
    not fit where float32 would is told to use float32."""
    if precision is None:
        return
    need = {p: reference_bytes(size, p, batch_tokens, longest) for p in PRECISIONS}
    if need[precision] <= free:
        return
    head = (f"--reference {precision} needs about {gib(need[precision])} on {device} {where}, and "
            f"{gib(max(0, free))} is left")
    if precision == "float64" and need["float32"] <= free:
        raise DeviceMemoryError(f"{head}; --reference float32 needs about {gib(need['float32'])} and fits: use it")
    also = "" if precision == "float32" else f" (float32: about {gib(need['float32'])})"
    raise DeviceMemoryError(f"{head}{also}; drop --reference, lower --batch-tokens or --max-prompt-tokens, or give "
                            "the trainer a device of its own (--train-device)")
