"""The memory plan: what a run will hold on its device, worked out before either stack loads, and what to change
when it does not fit.

    from divergence_probe.models.size import ModelSize
    from divergence_probe.runs.memory import PlanInputs, plan
    size = ModelSize.of(config, family, checkpoint_tensors(folder))  # config.json + safetensors headers only
    p = plan(PlanInputs(model=size, dtype_bytes=2, taps=frozenset({"resid_out"}), prompt_lengths=(512, 700), ...))
    p.batch_tokens, p.kv_cache_bytes, p.reduction_chunk_elements, p.needed, p.fits

Both stacks share one device (and one allocator: vLLM runs in this process). What is held at once, from the run
loop (runs/compare.py, runs/capture.py, engines/):
- each stack's weights, and vLLM's KV cache. vLLM used to be given half the GPU whatever it needed; the plan gives
  it the KV cache the run's sequences need (`kv_cache_memory_bytes`) and nothing more.
- one inference batch (at most `batch_tokens` prompt tokens): its taps, parked until the training stack has run
  every sequence of the batch (views of vLLM's step buffers, or clones of those it overwrites), and its logits
  ([tokens, vocab] per sequence, kept for the KL).
- one training sequence: its taps (views of transformers' activations), its logits and their FP32 logprobs.
- the reduction of that sequence's pairs: the taps of one width stacked into one `[taps, tokens, features]` pair per
  side (a copy of both sides), plus the reduction's own temporaries (FP32 working copies when it runs eagerly,
  per-block FP64 sums on a GPU). `reduction_chunk_elements` bounds the pairs reduced per call, and so both.
- --reference's checkpoint in float64/float32 on the trainer's device, from the run loop's start to its end: its
  weights, and one inference batch of its taps until the trainer has run that batch (runs/reference.py); and while
  it scores that batch, before the trainer runs it, one sequence's transients (eager attention's scores among them).
The engine's transient activations (its profile run at start-up, each step's forward) come on top of what is held
when they run. Allowances the arithmetic cannot see (the CUDA context, cuBLAS and NCCL workspaces, CUDA graphs,
allocator fragmentation) are named terms, so a measured peak can be set against each.

When the default batch does not fit, the plan first chunks the reduction (the statistics are the same to the bit:
tests/models/test_memory_plan.py) and then halves `batch_tokens` (the engine's batches change, and so its numerics) until
the run fits; a value the user set is never changed: the plan fails instead, in one line that names what was needed,
what was free and the options. `DIVERGENCE_PROBE_DEVICE_MEMORY=BYTES` replaces the detected free memory.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Iterator

from ..errors import DeviceMemoryError
from .out_of_memory import part_that_ran_out
from ..models.size import CPU_RUNTIME, ENV, GiB, ModelSize, gib, parse_bytes, system_memory

# A sequence's KV cache is whole blocks; the largest block vLLM picks for these models (its CPU backend's 128, CUDA's
# default 16), plus one block per sequence, so that a batch's step never waits for blocks (engines/vllm/stack.py needs one step).
KV_BLOCK = 128
# Allowances, in bytes, for what is not a tensor the plan can count.
CUDA_RUNTIME = 2 * GiB  # CUDA context, cuBLAS/NCCL workspaces, the sampler's warm-up, CUDA graphs (compiled mode)
FRAGMENTATION = 0.10  # the caching allocator rounds and splits blocks: share of the tensor bytes, weights aside
# Temporaries of the reduction per element of a pair reduced in one call (metrics.row_diff_sums): eagerly, FP32 copies
# of both sides, their difference, its absolute value and a product, and the int32 bit patterns of the ULP distance
# (12 four-byte tensors at its peak); compiled on a GPU, blocks_first's [pairs, blocks, 7] float64 sums (7*8/64 bytes);
# compiled on the CPU, one fused loop per row, nothing of the pair's size.
REDUCTION_TEMP_BYTES = {"eager": 48.0, "compiled-cuda": 0.875, "compiled-cpu": 0.0}
CHUNKS = (1 << 28, 1 << 26, 1 << 24, 1 << 22)  # elements per reduction call, tried in this order when unchunked fails
# remedies' arms that load stacks beside the shipped ones: the terms of what they hold (_remedies_terms)
ARM_TERMS = {"fp16": ("arm_fp16_trainer", "arm_fp16_engine"), "train_amp": ("arm_train_amp_trainer",)}


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Everything the plan is a function of (the manifest records it)."""

    model: ModelSize
    dtype_bytes: int
    taps: frozenset[str]
    prompt_lengths: tuple[int, ...]  # tokens of each prompt, in run order
    batch_tokens: int
    batch_tokens_fixed: bool  # set by the user: never lowered
    max_model_len: int
    device: str  # "cpu" or "cuda"
    free_bytes: int
    free_source: str  # where free_bytes came from
    # the inference stack is an engine (its StackClass.plan has KV bytes per token): it keeps a paged KV cache sized
    # here, fills max_num_batched_tokens in a profile run at start-up and hands over views of fused buffers; False: a
    # second trainer, which keeps none of them
    engine_kv: bool = True
    engine: str = "eager"
    new_tokens: int = 0  # generate mode: most tokens sampled per response
    samples: int = 1  # generate mode: responses per prompt
    kv_cache_bytes_fixed: int | None = None  # the user's kv_cache_memory_bytes, or vLLM CPU's VLLM_CPU_KVCACHE_SPACE
    engine_share: float | None = None  # the user's gpu_memory_utilization (in the manifest's spec already)
    kv_bytes_per_token: int | None = None  # the engine's KV cache per token (StackClass.plan); None: the run's dtype
    reduction: str = "compiled"  # "compiled" or "eager" (DIVERGENCE_PROBE_EAGER=1)
    # --batch-invariance: after the run, the trainer's micro-batches of batch_tokens padded tokens and a second trainer
    # (another SDPA kernel) beside the first
    noise_floor: bool = False
    tensor_parallel: int = 1  # the engine's tensor_parallel_size (engines/vllm/tensor_parallel.py)
    train_amp: bool = False  # --train-precision amp: the trainer holds FP32 weights and autocast's casts of them
    # --train-device on a device of its own ("cpu", "cuda:1"): planned apart, with its own free memory; None: the
    # trainer shares the engine's device (one plan)
    train_device: str | None = None
    train_tp: int = 1  # --train-tp: the trainer's ranks (engines/hf/tensor_parallel.py)
    train_free_bytes: int = 0
    train_free_source: str = ""
    # --placement alternate: the engine runs every prompt first and leaves the device before the trainer loads, so the
    # device holds one stack at a time (and what the trainer runs against comes back from the host one batch at a time)
    alternate: bool = False
    engine_passes: int = 1  # runs of the engine over every prompt: an ablation's engine-side combinations
    engine_noise: bool = False  # --engine-noise: the engine's scores of every sequence, and the other engine's
    beside: tuple[str, ...] = ()  # remedies: the arms that load stacks beside the shipped ones (spec.run.stacks_beside)
    cost_step: bool = False  # remedies: each side's step timed on one batch, the trainer's backward among them
    reference: str | None = None  # --reference float64|float32: a third stack, on the trainer's device (reference.py)

    def record(self) -> dict:
        """The inputs for the manifest; the free memory is the plan's `free` (the machine's state, not the run's)."""
        record = asdict(self)
        del record["free_bytes"], record["free_source"], record["train_free_bytes"], record["train_free_source"]
        del record["engine_share"]
        record["taps"] = sorted(self.taps)
        record["prompt_lengths"] = {"count": len(self.prompt_lengths), "total": sum(self.prompt_lengths),
                                    "longest": max(self.prompt_lengths, default=0)}
        return record


@dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    batch_tokens: int
    kv_cache_bytes: int  # 0 without a vLLM engine
    reduction_chunk_elements: int | None  # None: each sequence's pairs in one call, as before the plan existed
    terms: dict[str, int]  # bytes, by what holds them
    phases: dict[str, int]  # bytes held at the peak of each phase (sums of terms)
    needed: int
    batch_tokens_fitting: int | None = None  # with a fixed batch_tokens that does not fit: the largest that would
    # --train-device on a device of its own: what that device holds (terms, phases, needed), planned apart
    train_terms: dict[str, int] | None = None
    train_phases: dict[str, int] | None = None
    train_needed: int = 0

    @property
    def fits(self) -> bool:
        return self.engine_fits and self.train_fits

    @property
    def engine_fits(self) -> bool:
        """The engine's device (with the trainer too, unless it has its own)."""
        return self.needed <= self.inputs.free_bytes

    @property
    def train_fits(self) -> bool:
        """The trainer's own device (--train-device), when it has one."""
        return self.train_terms is None or self.train_needed <= self.inputs.train_free_bytes

    def engine_share(self, total_bytes: int) -> float:
        """The engine's part of the plan as a share of the device (what an engine that checks its share is free at
        start-up is asked for: StackClass.plan's `budget`)."""
        engine = self.terms["infer_weights"] + self.kv_cache_bytes + self.terms["engine_profile_activations"]
        return min(0.95, max(0.01, round(engine / total_bytes + 0.005, 3)))

    def record(self) -> dict:
        gib = lambda b: round(b / GiB, 3)  # noqa: E731
        return {
            "inputs": self.inputs.record(),
            "batch_tokens": {"asked": self.inputs.batch_tokens, "used": self.batch_tokens},
            "kv_cache_bytes": self.kv_cache_bytes,
            "reduction_chunk_elements": self.reduction_chunk_elements,
            "terms_bytes": dict(self.terms),
            "phases_bytes": dict(self.phases),
            "needed_bytes": self.needed,
            "needed_gib": gib(self.needed),
            "free": {"bytes": self.inputs.free_bytes, "gib": gib(self.inputs.free_bytes),
                     "source": self.inputs.free_source},
        } | ({} if self.train_terms is None else {"train_device": {
            "device": self.inputs.train_device, "terms_bytes": dict(self.train_terms),
            "phases_bytes": dict(self.train_phases), "needed_bytes": self.train_needed,
            "needed_gib": gib(self.train_needed),
            "free": {"bytes": self.inputs.train_free_bytes, "gib": gib(self.inputs.train_free_bytes),
                     "source": self.inputs.train_free_source}}})


def _batches(lengths: tuple[int, ...], max_tokens: int) -> Iterator[list[int]]:
    """prompts.batches on lengths alone (no scheduler limit: a larger batch is the conservative guess)."""
    group, size = [], 0
    for n in lengths:
        if group and size + n > max_tokens:
            yield group
            group, size = [], 0
        group.append(n)
        size += n
    if group:
        yield group


def _lengths(i: PlanInputs, batch_tokens: int) -> tuple[int, ...]:
    """The prompts' lengths; without them (a shape alone), one prompt that fills a batch."""
    return i.prompt_lengths or (min(batch_tokens, i.max_model_len),)


def longest_sequence(i: PlanInputs, batch_tokens: int) -> int:
    """Tokens of the run's longest sequence: its longest prompt with the most tokens sampled after it."""
    return max(_lengths(i, batch_tokens)) + max(0, i.new_tokens)


def _terms(i: PlanInputs, batch_tokens: int, chunk: int | None) -> tuple[dict[str, int], int, dict[str, int] | None]:
    """The byte count of every term for one choice of batch_tokens and chunking, the KV cache it implies, and the terms
    of the trainer's own device (--train-device; None when it shares the engine's)."""
    m, b = i.model, i.dtype_bytes
    engine = i.engine_kv
    samples, new = max(1, i.samples), max(0, i.new_tokens)
    per_batch = max(1, batch_tokens // samples) if samples > 1 or new else batch_tokens
    lengths = _lengths(i, batch_tokens)
    groups = list(_batches(lengths, per_batch))
    batch_rows = max(sum(n + new for n in group) * samples for group in groups)
    batch_logit_rows = max(sum(n + new - 1 for n in group) * samples for group in groups)
    longest = longest_sequence(i, batch_tokens)
    step_tokens = max(sum(group) * samples for group in groups)  # tokens one engine step computes (prefill)
    per_token = m.tap_elements_per_token(i.taps) * b
    terms: dict[str, int] = {}
    weights = m.parameters * b
    # --train-precision amp: FP32 master weights, and autocast's cache of their casts to the run's dtype (kept for
    # the whole autocast region of a forward)
    train_weights = m.parameters * 4 if i.train_amp else weights
    # --train-tp N: every rank loads the whole checkpoint before it keeps its slice (engines/hf/tensor_parallel.py); on
    # the CPU the ranks are N processes in the one host memory, on GPUs the planned device is rank 0's
    trainer_on_cpu = (i.train_device or i.device) == "cpu"
    if i.train_tp > 1 and trainer_on_cpu:
        train_weights *= i.train_tp
        terms["train_rank_processes"] = CPU_RUNTIME * i.train_tp
    terms["train_weights"] = train_weights
    if i.train_amp:
        terms["train_amp_weight_casts"] = weights
    # Tensor parallel over N ranks: on a GPU the plan is the first device's, where rank 0 sits beside the trainer and
    # the driver's gathered taps: its share of the weights (the RMSNorm weights whole in every rank), of the KV heads
    # (one at least: vLLM replicates a KV head over ranks when there are fewer) and of the MLP and attention widths;
    # KV budgets (kv_cache_memory_bytes, VLLM_CPU_KVCACHE_SPACE) are per rank. On the CPU every rank's share is in the
    # one host memory: the sum, and each rank's host copy of its taps until they are gathered.
    ranks = max(1, i.tensor_parallel) if engine else 1
    device_ranks = ranks if i.device == "cuda" else 1  # engine shares summed on this device: 1 of N, or all
    norms = (2 * m.layers + 1) * m.hidden * b
    terms["infer_weights"] = weights if ranks == 1 else (weights - norms) // device_ranks + norms * ranks // device_ranks
    kv_share = max(1, m.kv_heads // ranks) / m.kv_heads * (ranks // device_ranks)  # of the whole KV width, summed
    kv = 0
    if engine:
        blocks = max(-(-i.max_model_len // KV_BLOCK),  # vLLM refuses a cache that cannot hold one longest request
                     max(sum(-(-(n + new) // KV_BLOCK) + 1 for n in group) * samples for group in groups))
        kv = i.kv_cache_bytes_fixed or int(blocks * KV_BLOCK * (i.kv_bytes_per_token or m.kv_bytes_per_token(b))
                                           * kv_share)
    terms["kv_cache"] = kv * (ranks // device_ranks) if i.kv_cache_bytes_fixed else kv
    # a decoder layer's forward at its widest (the MLP: gate_up, its activation, the residual and hidden states),
    # attention's q/k/v and output: transient, once per step (per rank: its share of the sharded widths)
    act_per_token = (3 * m.intermediate // device_ranks + 2 * (m.q_width // device_ranks + 2 * int(m.kv_width * kv_share))
                     + 4 * m.hidden * (ranks // device_ranks)) * b
    max_batched = max(batch_tokens, i.max_model_len)  # vLLM's max_num_batched_tokens, which its profile run fills
    terms["engine_profile_activations"] = max_batched * act_per_token if engine else 0
    terms["engine_step_activations"] = step_tokens * act_per_token
    # prompt logprobs, per request: its logits, upcast to FP32 and log-softmaxed
    terms["engine_logprobs_transient"] = longest * m.vocab * (b + 8)
    terms["infer_taps"] = batch_rows * per_token
    terms["infer_views_retained"] = batch_rows * m.fused_views_retained_per_token(i.taps) * b if engine else 0
    terms["infer_logits"] = batch_logit_rows * m.vocab * b
    terms["train_taps"] = longest * per_token
    # tensor parallel on the CPU: rank 0's host copy of every tap and the others' of their slices, beside the gathered
    terms["tensor_parallel_rank_taps"] = 2 * terms["infer_taps"] if ranks > 1 and i.device != "cuda" else 0
    # --placement alternate, the engine in a worker process: each call's outputs come back through this process's
    # device on their way to the host, while the worker still holds its own copy
    terms["alternate_handover"] = terms["infer_taps"] + terms["infer_logits"] if i.alternate and engine else 0
    # one sequence's forward past what its taps hold, its logits ([T, V] in the dtype), their FP32 upcast and
    # log-softmax (token_logprobs), and the KL's float64 chunks of 256 rows (token_kl: both log-softmaxes, exp, product)
    terms["train_forward"] = (longest * (m.intermediate + 2 * m.hidden + m.q_width) * b
                              + longest * m.vocab * (b + 8) + min(longest, 256) * m.vocab * 8 * 4)
    # --batch-invariance: a trainer micro-batch's forward (batch_tokens padded tokens: its widest activation, logits
    # and their FP32 log-softmax), and the kernel floor's second trainer beside the first, which runs each sequence
    # while the micro-batch's scores are held (one trainer pass serves both floors: batch_invariance.KernelFloor)
    if i.noise_floor:
        terms["noise_floor_train_batch"] = (batch_tokens * (m.intermediate + 2 * m.hidden + m.q_width) * b
                                            + batch_tokens * m.vocab * (b + 8))
        terms["noise_floor_second_trainer"] = train_weights
    stacked = longest * m.stacked_elements_per_token(i.taps)
    pair = longest * m.tap_elements_per_token(i.taps) + (longest * m.vocab if "logits" in i.taps else 0)
    largest_single = max([longest * w for name, (w, _) in m.tap_widths().items() if name in i.taps]
                         + ([longest * m.vocab] if "logits" in i.taps else []) + [0])
    # capture._parts: calls of about `chunk` elements, a group cut into runs of at least two pairs (under 2 * chunk),
    # a group of up to three pairs or a pair larger than `chunk` whole
    bound = None if chunk is None else 2 * chunk + 3 * largest_single
    call = pair if bound is None else min(pair, bound)
    call_stacked = stacked if bound is None else min(stacked, bound)
    kind = "eager" if i.reduction == "eager" else f"compiled-{i.device}"
    terms["reduction_stacked_copies"] = 2 * call_stacked * b
    terms["reduction_temporaries"] = int(call * REDUCTION_TEMP_BYTES.get(kind, 0.0))
    # the trainer's taps of one reduction call, the logits tap included (a copy apart from the logits the KL moves)
    moved_taps = min(longest * per_token + (longest * m.vocab * b if "logits" in i.taps else 0), call * b)
    if i.reference is not None:  # on the trainer's device: moved with the trainer's terms when it has its own
        from ..numerics.reference import reference_terms

        terms |= reference_terms(m, i.reference, batch_rows, longest)  # the batch it runs
    train = _trainer_apart(i, terms, longest, call_stacked, moved_taps) if i.train_device is not None else None
    # on the CPU each tensor-parallel rank is a process of its own, with its own libraries (on a GPU: its own device)
    terms["runtime_allowance"] = CUDA_RUNTIME if i.device == "cuda" else CPU_RUNTIME * (1 + ranks if ranks > 1 else 1)
    _remedies_terms(i, batch_tokens, terms, kv, train)
    return terms, kv, train


def _remedies_terms(i: PlanInputs, batch_tokens: int, terms: dict[str, int], kv: int, train: dict | None) -> None:
    """A remedies run's terms: its cost step (a forward with grad over one batch, its logits, their FP32 log-softmax and
    both grads, a grad per weight) and the arms that load stacks beside (_with_arms: fp16's trainers and engine, its KV
    budget as planned, profile run and process; train_amp's FP32 trainer, casts and kernel floor's trainer)."""
    m, b, floor, trainer = i.model, i.dtype_bytes, int(i.noise_floor), terms if train is None else train
    if i.cost_step:  # kept for the backward, per token and layer, as transformers' Qwen layers keep them:
        top_k = m.intermediate // m.expert_intermediate if m.experts else 0  # the copies a mixture dispatches
        saved = (4 * m.intermediate + 6 * m.q_width + 4 * m.kv_width + (7 + top_k) * m.hidden  # the MLP's 4 widths,
                 + (3 * (m.q_width + m.kv_width) if m.qk_norm else 0)) * m.layers * b  # q/k/v, RoPE, norms in FP32
        trainer["cost_forward_backward"] = batch_tokens * (saved + m.vocab * (b + 16)) + m.parameters * b
    if "fp16" in i.beside:
        trainer["arm_fp16_trainer"] = m.parameters * 2 + floor * m.parameters * max(0, 2 - b)
        terms["arm_fp16_engine"] = (terms["infer_weights"] * 2 // b + kv + terms["engine_profile_activations"]
                                    + (CUDA_RUNTIME if i.device == "cuda" else CPU_RUNTIME))
    if "train_amp" in i.beside:
        trainer["arm_train_amp_trainer"] = m.parameters * (4 + b) + floor * m.parameters * (4 - b)


TRAIN_TERMS = ("train_weights", "train_amp_weight_casts", "train_taps", "noise_floor_train_batch",
               "noise_floor_second_trainer", "train_rank_processes", "reference_weights", "reference_batch",
               "reference_forward")


def _trainer_apart(i: PlanInputs, terms: dict[str, int], longest: int, call_stacked: int, moved_taps: int) -> dict:
    """--train-device on a device of its own: the trainer's terms move there (out of `terms`, which keeps the engine's
    device). The comparison stays on the engine's device, where a whole inference batch of taps is parked; what
    crosses is the trainer's side of one sequence: its taps of one reduction call (`moved_taps`), its logits, and the
    KL's float64 chunks computed there (compare.PendingScores, capture._stack)."""
    m, b = i.model, i.dtype_bytes
    kl = min(longest, 256) * m.vocab * 8 * 4
    train = {k: terms.pop(k) for k in TRAIN_TERMS if k in terms}
    train["train_forward"] = terms.pop("train_forward") - kl
    train["train_stacked_copies"] = call_stacked * b  # stacked on the trainer's device before they move
    terms["reduction_stacked_copies"] = call_stacked * b  # the engine's side; the trainer's arrives in moved_taps
    terms["train_outputs_moved"] = moved_taps + longest * m.vocab * b + kl
    kind = i.train_device.partition(":")[0]
    train["runtime_allowance"] = CUDA_RUNTIME if kind == "cuda" else CPU_RUNTIME
    train["fragmentation_allowance"] = int(FRAGMENTATION * sum(train.values())) if kind == "cuda" else 0
    return train


def _phase_tensors(t: dict[str, int], alternate: bool = False, engine_passes: int = 1) -> dict[str, tuple[int, int]]:
    """Bytes held at the peak of each phase on the engine's device (with the trainer's terms, when it shares it),
    before the allowances, as (weights, the rest). `alternate`: the engine's phases hold no trainer, the trainer's no
    engine (it left the device in between); the trainer's phase still holds one inference batch, moved back from the
    host.

    --reference: together, its weights beside the engine's steps (and an ablation's later engine starts) and its batch
    beside the trainer's; one at a time it loads once the engine has left, and the engine's phases never hold it. Its
    forward of a batch is a phase of its own (`reference_forward`): the run loop hands it the engine's batch before the
    trainer runs any of it (loop.score_both: add_sequences), so the trainer's forward, taps and reduction are not held
    then, and its batch fills as it runs."""
    trainer = t.get("train_weights", 0) + t.get("train_rank_processes", 0)
    engine = t["infer_weights"]
    engine_weights, train_weights = (engine, trainer) if alternate else (trainer + engine, trainer + engine)
    reference = t.get("reference_weights", 0)
    beside_engine = 0 if alternate else reference
    kv = t["kv_cache"]
    engine_kv, train_kv = (kv, 0) if alternate else (kv, kv)
    held = t["infer_taps"] + t["infer_views_retained"] + t["infer_logits"] + t["tensor_parallel_rank_taps"]
    return {
        "engine_start": (engine_weights + (beside_engine if engine_passes > 1 else 0),
                         engine_kv + t["engine_profile_activations"]),
        "engine_step": (engine_weights + beside_engine, engine_kv + held + t["engine_step_activations"]
                        + t["engine_logprobs_transient"] + t["alternate_handover"]),
        "train_and_reduce": (train_weights + reference, train_kv + held + t.get("train_taps", 0)
                             + t.get("train_forward", 0) + t.get("train_outputs_moved", 0)
                             + t["reduction_stacked_copies"] + t["reduction_temporaries"]
                             + t.get("train_amp_weight_casts", 0) + t.get("reference_batch", 0)),
    } | ({"reference_forward": (train_weights + reference, train_kv + held + t["reference_batch"]
                                + t["reference_forward"])} if "reference_forward" in t else {}) | (
        {"noise_floor": (train_weights + reference, train_kv + t.get("train_amp_weight_casts", 0)
                          + t["noise_floor_train_batch"] + t["noise_floor_second_trainer"] + t["train_forward"])}
         if "noise_floor_second_trainer" in t else {}) | _cost_phase(t, train_weights, train_kv
                                                                   + t.get("train_amp_weight_casts", 0))


def _cost_phase(t: dict[str, int], weights: int, held: int) -> dict:
    """remedies' cost step where the trainer's device holds it (cost_forward_backward), beside `weights` and `held`."""
    return {"cost_step": (weights, held + t["cost_forward_backward"])} if "cost_forward_backward" in t else {}


def _train_phases(t: dict[str, int]) -> dict[str, int]:
    """The trainer's own device (--train-device): its weights, one sequence's forward and taps, and the noise floor's
    batch or second trainer; the reference's weights throughout, its batch beside the trainer's forward and its own
    forward apart (_phase_tensors says why)."""
    fixed = t["train_weights"] + t.get("train_amp_weight_casts", 0) + t.get("train_rank_processes", 0) \
        + t.get("reference_weights", 0) + t["runtime_allowance"] + t["fragmentation_allowance"]
    return {"train_and_reduce": fixed + t["train_taps"] + t["train_forward"] + t["train_stacked_copies"]
            + t.get("reference_batch", 0)} | (
        {"reference_forward": fixed + t["reference_batch"] + t["reference_forward"]}
        if "reference_forward" in t else {}) | (
        {"noise_floor": fixed + t["noise_floor_train_batch"] + t["noise_floor_second_trainer"] + t["train_forward"]}
        if "noise_floor_second_trainer" in t else {}) | {k: fixed + w + r for k, (w, r) in _cost_phase(t, 0, 0).items()}


def _evaluate(i: PlanInputs, batch_tokens: int, chunk: int | None, **extra) -> MemoryPlan:
    terms, kv, train = _terms(i, batch_tokens, chunk)
    # the allocator's rounding is a share of what a phase allocates and frees as it runs: weights are allocated once,
    # whole, and under alternate the stack that left the device holds no blocks at all
    share = FRAGMENTATION if i.device == "cuda" else 0.0
    tensors = _phase_tensors(terms, i.alternate, i.engine_passes)
    phases = {phase: weights + rest + terms["runtime_allowance"] + int(share * rest)
              for phase, (weights, rest) in tensors.items()}
    terms["fragmentation_allowance"] = int(share * tensors[max(phases, key=phases.get)][1])  # at the plan's peak
    phases = _with_arms(phases, terms, i.beside)
    apart = {} if train is None else {"train_terms": train,
                                      "train_phases": (tp := _with_arms(_train_phases(train), train, i.beside)),
                                      "train_needed": max(tp.values())}
    return MemoryPlan(i, batch_tokens, kv, chunk, terms, phases, max(phases.values()), **apart, **extra)


def _with_arms(phases: dict[str, int], terms: dict[str, int], beside: tuple[str, ...]) -> dict[str, int]:
    """One more phase per arm that loads stacks beside (remedies): it runs a whole compare with them held."""
    return phases | {f"arm_{arm}": max(phases.values()) + sum(terms.get(n, 0) for n in names) for arm, names in ARM_TERMS.items()
                     if arm in beside and any(terms.get(n) for n in names)}


def _batch_candidates(i: PlanInputs) -> list[int]:
    """batch_tokens halved from the asked value, down to each prompt alone."""
    longest = max(i.prompt_lengths, default=1)
    out, bt = [i.batch_tokens], i.batch_tokens
    while bt > longest:
        bt = max(longest, bt // 2)
        out.append(bt)
    return out


def _first_fit(i: PlanInputs, candidates: list[int]) -> MemoryPlan | None:
    for bt in candidates:
        for chunk in (None, *CHUNKS):
            p = _evaluate(i, bt, chunk)
            if p.fits:
                return p
    return None


def plan(i: PlanInputs) -> MemoryPlan:
    """The plan for these inputs: the first choice that fits, unchunked before chunked, then smaller batches (unless
    the user set batch_tokens). One that does not fit is returned as the asked batch unchunked, with `fits` False
    (`check` turns it into the one-line error)."""
    found = _first_fit(i, [i.batch_tokens] if i.batch_tokens_fixed else _batch_candidates(i))
    if found is not None:
        return found
    fitting = _first_fit(i, _batch_candidates(i)) if i.batch_tokens_fixed else None
    return _evaluate(i, i.batch_tokens, None, batch_tokens_fitting=fitting.batch_tokens if fitting else None)


HOST_ENV = "DIVERGENCE_PROBE_HOST_MEMORY"


def placed(i: PlanInputs, asked: str, can_alternate: bool = True) -> tuple[MemoryPlan, str]:
    """The plan for --placement `asked` and why it is that placement. auto: both stacks together when they fit the
    device (nothing is kept on the host, the engine starts once), else one at a time when that fits and the run can
    (`can_alternate`); when neither fits, the plan with the smaller need, for `check` to refuse. A --reference is in
    both, in the phases that hold it: auto places the stacks where it fits too."""
    together = plan(replace(i, alternate=False))
    if asked == "together" or (asked == "auto" and not can_alternate):
        return together, f"asked (--placement {asked})" if asked == "together" else \
            "this run needs both stacks at once"
    alternate = plan(replace(i, alternate=True))
    if asked == "alternate":
        return alternate, "asked (--placement alternate)"
    beside, alone = ("", "") if i.reference is None else \
        (f" with the --reference {i.reference} stack", ", the reference beside the trainer,")
    if together.fits:
        return together, f"both stacks fit together{beside} ({gib(together.needed)} of {gib(i.free_bytes)} free)"
    if alternate.fits:
        return alternate, (f"both stacks together{beside} need {gib(together.needed)} of {i.device} memory but "
                           f"{gib(i.free_bytes)} is free; one at a time{alone} {gib(alternate.needed)}")
    return min((together, alternate), key=lambda p: p.needed), "neither placement fits"


def kept_output_bytes(p: MemoryPlan) -> int:
    """--placement alternate: the bytes of everything the engine hands over, kept on the host until the trainer has
    run against it: every sequence's taps (the logits tap too), its logits and logprobs, once per engine pass; in
    generate mode the engine's prefill of every sampled sequence, with --batch-invariance each sequence alone and
    batched (and a mixture's router logits both ways), with --engine-noise both engines' scores."""
    i, m, b = p.inputs, p.inputs.model, p.inputs.dtype_bytes
    samples, new = max(1, i.samples), max(0, i.new_tokens)
    lengths = _lengths(i, p.batch_tokens)
    rows = sum(n + new for n in lengths) * samples
    scored = sum(n + new - 1 for n in lengths) * samples
    per_row = m.tap_elements_per_token(i.taps) * b + (m.vocab * b if "logits" in i.taps else 0)
    copies = 1 + (1 if new else 0) + (2 if i.noise_floor else 0) + (2 if i.engine_noise else 0)
    routers = 2 * rows * m.experts * m.layers * (b + 8) if i.noise_floor and m.experts else 0
    return max(1, i.engine_passes) * (rows * per_row + scored * (m.vocab * b + 4) * copies + routers)


def host_budget(p: MemoryPlan) -> tuple[int, str]:
    """Host memory the kept outputs may take, and where the count came from: the system's available RAM (on the CPU
    less the plan's peak: the device is the host), or DIVERGENCE_PROBE_HOST_MEMORY."""
    override = os.environ.get(HOST_ENV)
    if override:
        return parse_bytes(override, HOST_ENV), HOST_ENV
    free, _ = system_memory()
    if p.inputs.device == "cpu":
        return max(0, free - p.needed), "system RAM available less the plan's peak (the CPU is the device)"
    return free, "system RAM available"


def keep_where(p: MemoryPlan, folder: str) -> dict:
    """Where --placement alternate keeps the engine's outputs: in host memory when they fit its budget, else in
    chunk files under `folder` when its disk has room; neither: one line, before anything loads."""
    import shutil

    kept = kept_output_bytes(p)
    budget, source = host_budget(p)
    record = {"bytes": kept, "host_budget_bytes": budget, "host_budget_source": source}
    if kept <= budget:
        return record | {"kept": "host"}
    parent = folder
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent) or "."
    disk = shutil.disk_usage(parent).free
    if kept <= disk:
        return record | {"kept": "file", "disk_free_bytes": disk}
    raise DeviceMemoryError(
        f"--placement alternate keeps the engine's outputs ({gib(kept)}) until the trainer runs, but the host may "
        f"hold {gib(budget)} ({source}) and {parent} has {gib(disk)} free; nothing was loaded. Options: fewer --taps "
        f"(--taps none keeps logprobs and logits only), fewer prompts (--num-prompts), --placement together on a "
        f"larger device, or free disk space there")


def check(p: MemoryPlan) -> MemoryPlan:
    """The plan if it fits; else one line naming the device that does not fit, what was needed, what was free, and the
    options (runs/reference_plan.check_planned says it first where the reference is what does not fit)."""
    if p.fits:
        return p
    i = p.inputs
    engine = not p.engine_fits
    terms, needed = (p.terms, p.needed) if engine else (p.train_terms, p.train_needed)
    device, free, source = (i.device, i.free_bytes, i.free_source) if engine else \
        (i.train_device, i.train_free_bytes, i.train_free_source)
    biggest = sorted(((v, k) for k, v in terms.items() if v), reverse=True)[:4]
    parts = ", ".join(f"{k} {gib(v)}" for v, k in biggest)
    options = []
    if p.batch_tokens_fitting:
        options.append(f"--batch-tokens {p.batch_tokens_fitting} (fits)")
    elif not i.batch_tokens_fixed:
        options.append("fewer or shorter prompts (--num-prompts, --max-prompt-tokens)")
    else:
        options.append("a lower --batch-tokens")
    if i.taps:
        taps_none = _first_fit(PlanInputs(**{**_fields(i), "taps": frozenset()}), _batch_candidates(i))
        options.append("--taps none (fits)" if taps_none else "fewer --taps")
    if not engine:
        options.append("another --train-device (or none: the engine's device)")
    elif device == "cpu":
        options.append("a machine with more memory (or --device cuda)")
    else:
        options.append("a GPU with more free memory" + ("" if i.train_device else " (or --train-device cuda:1)"))
    if i.beside:  # remedies' arms that load stacks beside the shipped ones
        fits = _first_fit(replace(i, beside=()), [p.batch_tokens] if i.batch_tokens_fixed else _batch_candidates(i))
        options.insert(0, f"--arms without {','.join(i.beside)} (the stacks they load beside the shipped ones; "
                          f"without them the run {'fits' if fits else 'still does not fit'})")
    options.append(f"a larger {ENV}" if source == ENV else f"{ENV}=BYTES if {source} is wrong")
    whose = ("" if i.train_device is None else " (the engine's device)") if engine else " (--train-device)"
    whose += " with one stack at a time (--placement alternate)" if i.alternate else ""
    raise DeviceMemoryError(
        f"the run needs about {gib(needed)} of {device} memory{whose} at its peak ({parts}; batch_tokens "
        f"{p.batch_tokens}) but {gib(free)} is free ({source}); nothing was loaded. "
        f"Options: {'; '.join(options)}")


def _fields(i: PlanInputs) -> dict:
    return {name: getattr(i, name) for name in i.__dataclass_fields__}


def enforce_cap(plan_: MemoryPlan, total_bytes: int) -> None:
    """With the override on a GPU, make the cap real for this process's allocator (both stacks: vLLM runs here), so
    a run planned for 80 GB on a larger card fails as it would on an 80 GB one instead of borrowing memory."""
    if plan_.inputs.device == "cuda" and plan_.inputs.free_source == ENV and total_bytes:
        import torch

        torch.cuda.set_per_process_memory_fraction(min(1.0, plan_.inputs.free_bytes / total_bytes))


def enforce_train_cap(plan_: MemoryPlan, total_bytes: int) -> None:
    """The same cap on the trainer's own GPU (--train-device cuda:N)."""
    i = plan_.inputs
    if (i.train_device or "").startswith("cuda") and i.train_free_source == ENV and total_bytes:
        import torch

        torch.cuda.set_per_process_memory_fraction(min(1.0, i.train_free_bytes / total_bytes), torch.device(i.train_device))


# ------------------------------------------------------------------------------------------- out of memory
def out_of_memory_error(error: BaseException, p: MemoryPlan | None, phase: str) -> DeviceMemoryError:
    """One line for an out-of-memory: where it happened, what the plan expected, and the fix."""
    where = part_that_ran_out(error) if phase == "run" else phase
    detail = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
    planned = ""
    fixes = "--batch-tokens lower than now, fewer --taps, shorter prompts (--max-prompt-tokens), or a larger device"
    if p is not None:
        planned = (f"; the plan expected {gib(p.needed)} of {gib(p.inputs.free_bytes)} free ({p.inputs.free_source}), "
                   f"batch_tokens {p.batch_tokens}")
        fixes = (f"--batch-tokens {max(1, p.batch_tokens // 2)}, fewer --taps, shorter prompts (--max-prompt-tokens), "
                 f"a larger device, or {ENV}=BYTES set below what other processes leave free")
        if p.inputs.engine_share is not None and "cache blocks" in detail.lower():
            # vLLM measured its share (what is in use on the whole device counts against it, other processes'
            # included) and found no room left for a KV cache: the user's share is the cause, not the plan
            fixes = (f"--engine-args gpu_memory_utilization above {p.inputs.engine_share} (vLLM counts all memory in "
                     "use on the device against it, other processes' included), or leave it out so that the memory "
                     "plan sizes the KV cache")
    return DeviceMemoryError(f"out of {p.inputs.device if p else 'device'} memory in {where} ({type(error).__name__}: "
                             f"{detail}){planned}; nothing was written. Try {fixes}")
