"""The memory plan: what a run will hold on its device, worked out before either stack loads, and what to change
when it does not fit.

    from divergence_probe.models.memory_plan import ModelSize, PlanInputs, plan
    size = ModelSize.of(config, checkpoint_tensors(folder))  # config.json + safetensors headers: no tensor is read
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
import re
import traceback
from dataclasses import asdict, dataclass, replace
from typing import Iterator

from ..errors import DeviceMemoryError

ENV = "DIVERGENCE_PROBE_DEVICE_MEMORY"
GiB = 1 << 30
MAX_DEVICE_BYTES = 1 << 60  # an override above any device's memory is a typo
# A sequence's KV cache is whole blocks; the largest block vLLM picks for these models (its CPU backend's 128, CUDA's
# default 16), plus one block per sequence, so that a batch's step never waits for blocks (engines/vllm/stack.py needs one step).
KV_BLOCK = 128
# Allowances, in bytes, for what is not a tensor the plan can count.
CUDA_RUNTIME = 2 * GiB  # CUDA context, cuBLAS/NCCL workspaces, the sampler's warm-up, CUDA graphs (compiled mode)
CPU_RUNTIME = 1 * GiB  # the libraries vLLM imports and starts (the process's RSS before it is already counted)
FRAGMENTATION = 0.10  # the caching allocator rounds and splits blocks: share of the counted tensor bytes
# Temporaries of the reduction per element of a pair reduced in one call (metrics.row_diff_sums): eagerly, FP32 copies
# of both sides, their difference, its absolute value and a product, and the int32 bit patterns of the ULP distance
# (12 four-byte tensors at its peak); compiled on a GPU, blocks_first's [pairs, blocks, 7] float64 sums (7*8/64 bytes);
# compiled on the CPU, one fused loop per row, nothing of the pair's size.
REDUCTION_TEMP_BYTES = {"eager": 48.0, "compiled-cuda": 0.875, "compiled-cpu": 0.0}
CHUNKS = (1 << 28, 1 << 26, 1 << 24, 1 << 22)  # elements per reduction call, tried in this order when unchunked fails


@dataclass(frozen=True)
class ModelSize:
    """The sizes the plan needs, from config.json; `parameters` from the safetensors headers (one count, however
    the checkpoint stores them: both stacks load them in the run's dtype)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool
    parameters: int
    # the family's decoder-layer taps and their features per token (models/: Family.layer_taps, widths)
    layer_tap_widths: tuple[tuple[str, int], ...] = ()
    experts: int = 0  # a mixture of experts: experts per layer (0: a dense MLP)
    expert_intermediate: int = 0  # one expert's intermediate size

    @classmethod
    def of(cls, config: dict, tensors: dict | None = None) -> "ModelSize":
        """`tensors`: checkpoint.checkpoint_tensors(folder) (name -> Tensor with a shape); None: counted from the
        config (a shape without files, for the benchmark's larger shapes). The taps and the MLP's width come from the
        model's family: a mixture of experts' per-token MLP is its top-k experts (`intermediate` = top_k x one
        expert's width), its router_logits tap one feature per expert."""
        from types import SimpleNamespace

        from ..models import dims, get_family

        family = get_family(config.get("model_type", "qwen2"))
        sizes = dims(SimpleNamespace(**config))
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        experts = sizes.get("experts", 0) if family.top_k_field else 0
        expert_width = int(config["moe_intermediate_size"]) if experts else 0
        intermediate = int(config[family.top_k_field]) * expert_width if experts else int(config["intermediate_size"])
        size = cls(hidden=hidden, intermediate=intermediate,
                   layers=int(config["num_hidden_layers"]), heads=heads,
                   kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
                   vocab=int(config["vocab_size"]), qk_norm="q_norm" in family.layer_taps, parameters=0,
                   layer_tap_widths=tuple((t, sizes[family.widths[t]]) for t in family.layer_taps),
                   experts=experts, expert_intermediate=expert_width)
        if tensors is None:
            count = size.parameters_from_config(bool(config.get("tie_word_embeddings")),
                                                config.get("model_type") == "qwen2")
        else:
            count = 0
            for tensor in tensors.values():
                n = 1
                for d in tensor.shape:
                    n *= d
                count += n
        return cls(**{**asdict(size), "parameters": count})

    def parameters_from_config(self, tied: bool, qkv_bias: bool) -> int:
        q, kv, h = self.q_width, self.kv_width, self.hidden
        mlp = (self.experts * 3 * h * self.expert_intermediate + self.experts * h) if self.experts else \
            3 * h * self.intermediate  # experts' gate/up/down and the router, or one dense MLP
        layer = h * (q + 2 * kv) + q * h + mlp + 2 * h
        layer += (q + 2 * kv) if qkv_bias else 0
        layer += 2 * self.head_dim if self.qk_norm else 0
        return self.layers * layer + self.vocab * h * (1 if tied else 2) + h

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def tap_widths(self) -> dict[str, tuple[int, int]]:
        """Per canonical tap: (features per token, how many of it a forward makes); `logits` is counted apart."""
        h, n = self.hidden, self.layers
        return {"embed": (h, 1), **{name: (w, n) for name, w in self.layer_tap_widths}, "final_norm": (h, 1)}

    def tap_elements_per_token(self, taps: frozenset[str]) -> int:
        """Elements of every selected tap but the logits, per token of one sequence (one side)."""
        return sum(width * count for name, (width, count) in self.tap_widths().items() if name in taps)

    def stacked_elements_per_token(self, taps: frozenset[str]) -> int:
        """Of those, the elements of taps that share their width with another selected tap: runs/capture.py stacks these
        into one pair per width, a copy of both sides (a tap alone in its width is reduced as a view)."""
        by_width: dict[int, list[int]] = {}
        for name, (width, count) in self.tap_widths().items():
            if name in taps:
                by_width.setdefault(width, []).append(count)
        return sum(width * sum(counts) for width, counts in by_width.items() if sum(counts) > 1)

    def fused_views_retained_per_token(self, taps: frozenset[str]) -> int:
        """Elements per token that vLLM's hand-over keeps alive beyond the taps themselves: a tap that is a view of a
        fused output (v_proj of qkv_proj's; gate_proj and up_proj of gate_up_proj's; Qwen2's q_rope and k_rope, which
        RoPE writes in place into qkv_proj's output) keeps that whole buffer, of which only the selected views are
        counted as taps. q_proj and k_proj are clones (engines/vllm/stack.py REWRITTEN); Qwen3 rotates its q/k norms' outputs."""
        q, kv, i = self.q_width, self.kv_width, self.intermediate
        qkv_views = {"v_proj": kv} | ({} if self.qk_norm else {"q_rope": q, "k_rope": kv})
        fused = [(q + 2 * kv, qkv_views), (2 * i, {"gate_proj": i, "up_proj": i})]
        extra = 0
        for width, views in fused:
            held = [w for name, w in views.items() if name in taps]
            if held:
                extra += width - sum(held)
        return extra * self.layers

    def kv_bytes_per_token(self, kv_dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_width * kv_dtype_bytes


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
    infer: str = "vllm"
    engine: str = "eager"
    new_tokens: int = 0  # generate mode: most tokens sampled per response
    samples: int = 1  # generate mode: responses per prompt
    kv_cache_bytes_fixed: int | None = None  # the user's kv_cache_memory_bytes, or vLLM CPU's VLLM_CPU_KVCACHE_SPACE
    engine_share: float | None = None  # the user's gpu_memory_utilization (in the manifest's spec already)
    kv_dtype_bytes: int | None = None  # None: the run's dtype
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

    def engine_args(self) -> dict:
        """vllm.LLM keywords for the KV budget (CUDA only). vLLM 0.24 still checks at start-up that
        gpu_memory_utilization x total memory is free, even when kv_cache_memory_bytes is given; the share asked is
        the engine's part of the plan, so the check passes whenever the plan fits. On the CPU the KV cache stays
        VLLM_CPU_KVCACHE_SPACE (vLLM CPU's platform sets kv_cache_memory_bytes from it over any engine arg)."""
        if self.inputs.device != "cuda" or self.inputs.infer != "vllm" or self.inputs.kv_cache_bytes_fixed:
            return {}
        return {"kv_cache_memory_bytes": self.kv_cache_bytes}

    def gpu_memory_utilization(self, total_bytes: int) -> float:
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


def _terms(i: PlanInputs, batch_tokens: int, chunk: int | None) -> tuple[dict[str, int], int, dict[str, int] | None]:
    """The byte count of every term for one choice of batch_tokens and chunking, the KV cache it implies, and the terms
    of the trainer's own device (--train-device; None when it shares the engine's)."""
    m, b = i.model, i.dtype_bytes
    vllm = i.infer == "vllm"
    samples, new = max(1, i.samples), max(0, i.new_tokens)
    per_batch = max(1, batch_tokens // samples) if samples > 1 or new else batch_tokens
    lengths = i.prompt_lengths or (min(batch_tokens, i.max_model_len),)
    groups = list(_batches(lengths, per_batch))
    batch_rows = max(sum(n + new for n in group) * samples for group in groups)
    batch_logit_rows = max(sum(n + new - 1 for n in group) * samples for group in groups)
    longest = max(n + new for n in lengths)
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
    ranks = max(1, i.tensor_parallel) if vllm else 1
    device_ranks = ranks if i.device == "cuda" else 1  # engine shares summed on this device: 1 of N, or all
    norms = (2 * m.layers + 1) * m.hidden * b
    terms["infer_weights"] = weights if ranks == 1 else (weights - norms) // device_ranks + norms * ranks // device_ranks
    kv_share = max(1, m.kv_heads // ranks) / m.kv_heads * (ranks // device_ranks)  # of the whole KV width, summed
    kv = 0
    if vllm:
        kv_b = i.kv_dtype_bytes or b
        blocks = max(-(-i.max_model_len // KV_BLOCK),  # vLLM refuses a cache that cannot hold one longest request
                     max(sum(-(-(n + new) // KV_BLOCK) + 1 for n in group) * samples for group in groups))
        kv = i.kv_cache_bytes_fixed or int(blocks * KV_BLOCK * m.kv_bytes_per_token(kv_b) * kv_share)
    terms["kv_cache"] = kv * (ranks // device_ranks) if i.kv_cache_bytes_fixed else kv
    # a decoder layer's forward at its widest (the MLP: gate_up, its activation, the residual and hidden states),
    # attention's q/k/v and output: transient, once per step (per rank: its share of the sharded widths)
    act_per_token = (3 * m.intermediate // device_ranks + 2 * (m.q_width // device_ranks + 2 * int(m.kv_width * kv_share))
                     + 4 * m.hidden * (ranks // device_ranks)) * b
    max_batched = max(batch_tokens, i.max_model_len)  # vLLM's max_num_batched_tokens, which its profile run fills
    terms["engine_profile_activations"] = max_batched * act_per_token if vllm else 0
    terms["engine_step_activations"] = step_tokens * act_per_token
    # prompt logprobs, per request: its logits, upcast to FP32 and log-softmaxed
    terms["engine_logprobs_transient"] = longest * m.vocab * (b + 8)
    terms["infer_taps"] = batch_rows * per_token
    terms["infer_views_retained"] = batch_rows * m.fused_views_retained_per_token(i.taps) * b if vllm else 0
    terms["infer_logits"] = batch_logit_rows * m.vocab * b
    terms["train_taps"] = longest * per_token
    # tensor parallel on the CPU: rank 0's host copy of every tap and the others' of their slices, beside the gathered
    terms["tensor_parallel_rank_taps"] = 2 * terms["infer_taps"] if ranks > 1 and i.device != "cuda" else 0
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
    train = _trainer_apart(i, terms, longest, call_stacked, moved_taps) if i.train_device is not None else None
    counted = sum(terms.values())
    # on the CPU each tensor-parallel rank is a process of its own, with its own libraries (on a GPU: its own device)
    terms["runtime_allowance"] = CUDA_RUNTIME if i.device == "cuda" else CPU_RUNTIME * (1 + ranks if ranks > 1 else 1)
    terms["fragmentation_allowance"] = int(FRAGMENTATION * counted) if i.device == "cuda" else 0
    return terms, kv, train


TRAIN_TERMS = ("train_weights", "train_amp_weight_casts", "train_taps", "noise_floor_train_batch",
               "noise_floor_second_trainer", "train_rank_processes")


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


def _phases(t: dict[str, int], alternate: bool = False) -> dict[str, int]:
    """Bytes held at the peak of each phase on the engine's device (with the trainer's terms, when it shares it).
    `alternate`: the engine's phases hold no trainer, the trainer's no engine (it left the device in between); the
    trainer's phase still holds one inference batch, moved back from the host."""
    allowances = t["runtime_allowance"] + t["fragmentation_allowance"]
    trainer = t.get("train_weights", 0) + t.get("train_rank_processes", 0)
    engine = t["infer_weights"] + t["kv_cache"]
    fixed = trainer + engine + allowances
    engine_fixed, train_fixed = (engine + allowances, trainer + allowances) if alternate else (fixed, fixed)
    held = t["infer_taps"] + t["infer_views_retained"] + t["infer_logits"] + t["tensor_parallel_rank_taps"]
    fixed = train_fixed
    return {
        "engine_start": engine_fixed + t["engine_profile_activations"],
        "engine_step": engine_fixed + held + t["engine_step_activations"] + t["engine_logprobs_transient"],
        "train_and_reduce": fixed + held + t.get("train_taps", 0) + t.get("train_forward", 0)
        + t.get("train_outputs_moved", 0) + t["reduction_stacked_copies"] + t["reduction_temporaries"]
        + t.get("train_amp_weight_casts", 0),
    } | ({"noise_floor": fixed + t.get("train_amp_weight_casts", 0)
          + t["noise_floor_train_batch"] + t["noise_floor_second_trainer"] + t["train_forward"]}
         if "noise_floor_second_trainer" in t else {})


def _train_phases(t: dict[str, int]) -> dict[str, int]:
    """The trainer's own device (--train-device): its weights, one sequence's forward and taps, and the noise floor's
    batch or second trainer."""
    fixed = t["train_weights"] + t.get("train_amp_weight_casts", 0) + t.get("train_rank_processes", 0) \
        + t["runtime_allowance"] + t["fragmentation_allowance"]
    return {"train_and_reduce": fixed + t["train_taps"] + t["train_forward"] + t["train_stacked_copies"]} | (
        {"noise_floor": fixed + t["noise_floor_train_batch"] + t["noise_floor_second_trainer"] + t["train_forward"]}
        if "noise_floor_second_trainer" in t else {})


def _evaluate(i: PlanInputs, batch_tokens: int, chunk: int | None, **extra) -> MemoryPlan:
    terms, kv, train = _terms(i, batch_tokens, chunk)
    phases = _phases(terms, i.alternate)
    apart = {} if train is None else {"train_terms": train, "train_phases": (tp := _train_phases(train)),
                                      "train_needed": max(tp.values())}
    return MemoryPlan(i, batch_tokens, kv, chunk, terms, phases, max(phases.values()), **apart, **extra)


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
    (`can_alternate`); when neither fits, the plan with the smaller need, for `check` to refuse."""
    together = plan(replace(i, alternate=False))
    if asked == "together" or (asked == "auto" and not can_alternate):
        return together, f"asked (--placement {asked})" if asked == "together" else \
            "this run needs both stacks at once"
    alternate = plan(replace(i, alternate=True))
    if asked == "alternate":
        return alternate, "asked (--placement alternate)"
    if together.fits:
        return together, f"both stacks fit together ({_gib(together.needed)} of {_gib(i.free_bytes)} free)"
    if alternate.fits:
        return alternate, (f"both stacks together need {_gib(together.needed)} of {i.device} memory but "
                           f"{_gib(i.free_bytes)} is free; one at a time {_gib(alternate.needed)}")
    return min((together, alternate), key=lambda p: p.needed), "neither placement fits"


def kept_output_bytes(p: MemoryPlan) -> int:
    """--placement alternate: the bytes of everything the engine hands over, kept on the host until the trainer has
    run against it: every sequence's taps (the logits tap too), its logits and logprobs, once per engine pass; in
    generate mode the engine's prefill of every sampled sequence, with --batch-invariance each sequence alone and
    batched (and a mixture's router logits both ways), with --engine-noise both engines' scores."""
    i, m, b = p.inputs, p.inputs.model, p.inputs.dtype_bytes
    samples, new = max(1, i.samples), max(0, i.new_tokens)
    lengths = i.prompt_lengths or (min(p.batch_tokens, i.max_model_len),)
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
    free, _ = _system_memory()
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
        f"--placement alternate keeps the engine's outputs ({_gib(kept)}) until the trainer runs, but the host may "
        f"hold {_gib(budget)} ({source}) and {parent} has {_gib(disk)} free; nothing was loaded. Options: fewer --taps "
        f"(--taps none keeps logprobs and logits only), fewer prompts (--num-prompts), --placement together on a "
        f"larger device, or free disk space there")


def check(p: MemoryPlan) -> MemoryPlan:
    """The plan if it fits; else one line naming the device that does not fit, what was needed, what was free, and the
    options."""
    if p.fits:
        return p
    i = p.inputs
    engine = not p.engine_fits
    terms, needed = (p.terms, p.needed) if engine else (p.train_terms, p.train_needed)
    device, free, source = (i.device, i.free_bytes, i.free_source) if engine else \
        (i.train_device, i.train_free_bytes, i.train_free_source)
    biggest = sorted(((v, k) for k, v in terms.items() if v), reverse=True)[:4]
    parts = ", ".join(f"{k} {_gib(v)}" for v, k in biggest)
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
    options.append(f"a larger {ENV}" if source == ENV else f"{ENV}=BYTES if {source} is wrong")
    whose = ("" if i.train_device is None else " (the engine's device)") if engine else " (--train-device)"
    whose += " with one stack at a time (--placement alternate)" if i.alternate else ""
    raise DeviceMemoryError(
        f"the run needs about {_gib(needed)} of {device} memory{whose} at its peak ({parts}; batch_tokens "
        f"{p.batch_tokens}) but {_gib(free)} is free ({source}); nothing was loaded. "
        f"Options: {'; '.join(options)}")


def _fields(i: PlanInputs) -> dict:
    return {name: getattr(i, name) for name in i.__dataclass_fields__}


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


# ------------------------------------------------------------------------------------------- the device's memory
def parse_bytes(text: str, env: str = ENV) -> int:
    """`80000000000`, `8e10`, `80GB`, `74.5GiB`, `512MiB`: a byte count."""
    m = re.fullmatch(r"\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[0-9]+)?)\s*([kmgt]i?b?)?\s*", text.lower())
    if not m:
        raise DeviceMemoryError(f"{env}={text!r} is not a byte count; give bytes (80000000000) or e.g. 80GB, 74.5GiB")
    scale = {None: 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
             "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": GiB, "gib": GiB, "ti": 1 << 40,
             "tib": 1 << 40}[m.group(2)]
    count = float(m.group(1)) * scale
    if not 0 < count <= MAX_DEVICE_BYTES:  # 1e999 is inf: no int holds it, and no device is that large
        raise DeviceMemoryError(f"{env}={text!r} must be positive and at most {MAX_DEVICE_BYTES >> 50} PiB; give "
                                "the device's bytes (e.g. 80GB)")
    value = int(count)
    return value


def device_memory(device: str) -> tuple[int, int, str]:
    """(free bytes, total bytes, where the free count came from) of a device a stack loads on ("cpu", "cuda",
    "cuda:N"). The override caps the free memory of each device (a GPU shared with others, or a test); on the CPU the
    memory is the system's RAM."""
    override = os.environ.get(ENV)
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device) if ":" in device else None)
        source = "torch.cuda.mem_get_info" + (f"({device})" if ":" in device else "")
    else:
        free, total = _system_memory()
        source = "system RAM available"
    if override:
        return parse_bytes(override), total, f"{ENV}"
    return free, total, source


def _system_memory() -> tuple[int, int]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:
        pages = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * pages, os.sysconf("SC_PHYS_PAGES") * pages


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


# ------------------------------------------------------------------------------------------- what was measured
class Peaks:
    """Peak device memory per phase of the run loop (CUDA: torch's allocator, which both stacks share; vLLM's KV
    cache and weights are in it too), and of the trainer's own GPU when it has one (--train-device cuda:N). On the
    CPU no allocator keeps a peak: nothing is recorded, and benchmarks/memory_plan.py counts the tap bytes a run holds
    instead."""

    def __init__(self, device: str, train_device: str | None = None) -> None:
        self.cuda = device == "cuda"
        self.devices = ([None] if self.cuda else []) + ([train_device] if (train_device or "").startswith("cuda") else [])
        self.peaks: dict[str, int] = {}

    def start(self) -> None:
        import torch

        for device in self.devices:
            torch.cuda.reset_peak_memory_stats(device)

    def end(self, phase: str) -> None:
        import torch

        for device in self.devices:
            key = phase if device is None else f"{phase} ({device})"
            self.peaks[key] = max(self.peaks.get(key, 0), int(torch.cuda.max_memory_allocated(device)))

    def record(self) -> dict:
        if not self.devices:
            return {"device": "cpu: no allocator peak (benchmarks/memory_plan.py counts the capture's bytes)"}
        import torch

        return {"max_memory_allocated_bytes_by_phase": dict(self.peaks),
                "max_memory_reserved_bytes": int(torch.cuda.max_memory_reserved()) if self.cuda else None}


def engine_report(stack) -> dict:
    """What vLLM itself reports of its weights and KV cache (read from the live engine; absent where it keeps none)."""
    runner, llm = getattr(stack, "runner", None), getattr(stack, "llm", None)
    out = {}
    weights = getattr(runner, "model_memory_usage", None)
    if weights:
        out["weights_bytes"] = int(weights)
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        out["kv_cache_memory_bytes"] = cache.kv_cache_memory_bytes
        if cache.num_gpu_blocks:
            out["kv_blocks"], out["block_size"] = int(cache.num_gpu_blocks), int(cache.block_size)
    except AttributeError:
        pass
    return out


class CountingCapture:
    """A capture (compare.score_both's park/add_sequences/pair/finish_prompt) that files every hand-over with the real
    one and counts what the run holds, independently of the plan's arithmetic: per inference batch (a batch starts at the first park
    after a training-side finish) and per training sequence, the bytes of the tensors handed over (`taps`, `logits`)
    and of the distinct storages behind them (`storage`: a view keeps its whole buffer alive, e.g. vLLM's fused
    q/k/v output behind v_proj)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.batches: list[dict[str, int]] = []
        self.sequences: dict[int, dict[str, int]] = {}
        self._storages: dict[int, int] = {}
        self._sequence_storages: dict[int, dict[int, int]] = {}
        self._new_batch = True

    @staticmethod
    def _count(into: dict[str, int], storages: dict[int, int], name: str, x) -> None:
        if name == "logits":  # the plan's infer_logits; a sequence's logits are held with or without the tap
            into["logits"] += x.numel() * x.element_size()
            return
        into["taps"] += x.numel() * x.element_size()
        storage = x.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    def park(self, key, tap, x) -> None:
        from ..taps import each_tap

        if self._new_batch:
            self.batches.append({"taps": 0, "logits": 0, "storage": 0})
            self._storages, self._new_batch = {}, False
        for k, t in each_tap(tap, x):
            self._count(self.batches[-1], self._storages, k.name, t)
        self.batches[-1]["storage"] = sum(self._storages.values())
        self.inner.park(key, tap, x)

    def add_sequences(self, sequences) -> None:
        self.inner.add_sequences(sequences)

    def pair(self, key, tap, x) -> None:
        counts = self.sequences.setdefault(key, {"taps": 0, "logits": 0, "storage": 0})
        storages = self._sequence_storages.setdefault(key, {})
        self._count(counts, storages, tap.name, x)
        counts["storage"] = sum(storages.values())
        self.inner.pair(key, tap, x)

    def finish_prompt(self, key) -> None:
        self._new_batch = True
        self._sequence_storages.pop(key, None)
        self.inner.finish_prompt(key)

    def largest(self) -> dict[str, int]:
        """The largest batch's and the longest sequence's counts, as the plan's terms are."""
        most = lambda rows, field: max((r[field] for r in rows), default=0)  # noqa: E731
        seqs = list(self.sequences.values())
        return {"infer_taps_handed_over": most(self.batches, "taps"), "infer_taps_storage": most(self.batches, "storage"),
                "infer_logits": most(self.batches, "logits"), "train_taps_handed_over": most(seqs, "taps"),
                "train_taps_storage": most(seqs, "storage")}


# ------------------------------------------------------------------------------------------- out of memory
_OOM_TEXT = ("out of memory", "can't allocate memory", "no available memory for the cache blocks",
             "larger than the available kv cache memory", "less than desired gpu memory utilization",
             "less than desired cpu memory utilization", "less than requested memory for kv")


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), a CPU allocation failure, or one of vLLM's start-up errors for too little
    memory (its text: vllm/v1/core/kv_cache_utils.py, v1/worker/utils.request_memory, cpu_worker.py), also when
    wrapped in one of our errors."""
    import torch

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.OutOfMemoryError):
            return True
        if isinstance(error, (RuntimeError, ValueError, MemoryError)) or type(error).__name__ == "StackError":
            text = str(error).lower()
            if isinstance(error, MemoryError) or any(t in text for t in _OOM_TEXT):
                return True
        error = error.__cause__ or error.__context__
    return False


def _where(error: BaseException) -> str:
    """Which part of the run ran out: the deepest of our modules (or vLLM) in the traceback."""
    places = {"engines/hf": "the training stack's forward", "runs/capture.py": "the tap reduction",
              "numerics/fused.py": "the tap reduction", "numerics/metrics.py": "the tap reduction", "engines/vllm": "the inference engine",
              "/vllm/": "the inference engine", "runs/compare.py": "the run loop"}
    where = "the run"
    for frame in traceback.extract_tb(error.__traceback__):
        path = frame.filename.replace(os.sep, "/")
        for key, name in places.items():
            if key in path:
                where = name
    return where


def out_of_memory_error(error: BaseException, p: MemoryPlan | None, phase: str) -> DeviceMemoryError:
    """One line for an out-of-memory: where it happened, what the plan expected, and the fix."""
    where = _where(error) if phase == "run" else phase
    detail = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
    planned = ""
    fixes = "--batch-tokens lower than now, fewer --taps, shorter prompts (--max-prompt-tokens), or a larger device"
    if p is not None:
        planned = (f"; the plan expected {_gib(p.needed)} of {_gib(p.inputs.free_bytes)} free ({p.inputs.free_source}), "
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
