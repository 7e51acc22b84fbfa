"""Push the trainer's weights into the running vLLM engine, then prove it computes with them.

Push: vLLM's own in-place reload (`LLM.collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)`,
the worker's `reload_weights`): it puts every layer back into its checkpoint layout, runs the model's own
`load_weights` (which stacks q,k,v into qkv_proj and gate,up into gate_up_proj and ties lm_head to the embedding),
re-runs each layer's post-load processing (on the CPU: packing the GEMM weights and dropping `layer.weight`) and
copies the result into the tensors the engine already holds. No engine restart. Two gaps in that path are closed
here: a tied head is processed only as its embedding (vLLM's `model_loader/reload` docstring, limitation 2), so on
a CPU whose GEMM packs its own copy of the weight (vLLM's AMX path) the lm_head keeps the old embedding; its own
post-load processing is run again. And a mixture of experts' kernel lays its weights out only on the first load
(vllm 0.32 `unquantized_fused_moe_method._setup_kernel` skips `fused_experts.process_weights_after_loading` on a
weight update), so on the CPU the reloaded experts stay in checkpoint layout while the kernel reads its prepacked tile
order, and the engine computes with scrambled experts (measured: logprobs off by up to 0.2 after one push); the
kernel's post-load processing is run again on every MoE layer.

Check (engines/weight_check.py compares): what the engine computes with, tensor by tensor, against the trainer's
tensors mapped as vLLM's loader maps them (its `packed_modules_mapping`; the tied lm_head is the embedding; a mixture
of experts' tensors as the vLLM layout's `experts` (engines/vllm/layouts.py) says its MoE loader fills them, then laid out by the experts
kernel's own post-load processing run on a copy). "Computes with", not "stores": on the CPU a linear layer's `weight`
is an empty tensor after loading and the GEMM reads a packed copy, so a linear weight is read back by running the
layer's own GEMM on an identity matrix (exact: one nonzero product per output).

A compiled engine (rl --engine compiled) computes with the same tensors: vLLM's reload copies the new values into the
tensors the engine already holds, so a graph captured with their addresses (CUDA graphs) reads the new values, and
torch.compile's code reads the module's tensors at each call (on the CPU, checked: a push of weights moved by half their
spread left the compiled engine within the eager engine's mismatch of transformers). That holds only while every
tensor keeps its storage: when the engine replays CUDA graphs, each check also requires every parameter's address to
be the one it had when the sync began (`moved_storage`); a tensor given new storage by a push (a post-load step that
replaces instead of copying) would be read by the check while the graphs read the old one, and is a SyncError.

Stale-cache probe: with prefix caching on, KV blocks computed before a push are served after it unless the cache is
reset. A fixed prompt of a little over two KV blocks (random token ids: no rollout shares its prefix) is scored once
per push, through the prefix cache, and vLLM's own count of the prompt tokens it served from the cache
(`RequestOutput.num_cached_tokens`) must be 0: then every token was computed with the engine's current weights (the
comparison proves those are the trainer's), which is what a fresh engine with these weights computes. No comparison
of logprobs, so it cannot false-alarm on rounding (two copies of one prompt in one engine step can come out of the
CPU kernels with different roundings). A count that vLLM does not report (None) is an error, not a pass. The probe
rides the next rollout's generate call (`request`, then `verdict` on its output: one more short prompt in a batch the
engine runs anyway) rather than costing an engine call of its own; the same call is what would read a stale block,
so the rollout that follows a push is the one it proves. `check` scores it alone, where no rollout follows (a run's
reset, its last push). Positive control, without an engine call: before the push, the probe's full blocks must be in
the engine's prefix cache (the scheduler's KV cache manager looks the prompt's block hashes up in its block pool, as
it does for an arriving request); else a missing reset would go unseen (rollouts evicted the blocks) and the check
would prove nothing, so that is an error too. Whether the score moved from the previous check's is reported, not
required (BF16 activations can absorb a small update; scored inside a rollout's batch, kernels that are not
batch-invariant move it too).
"""

from __future__ import annotations

import inspect
import time
from typing import Iterable, Mapping

import torch

from ...errors import StaleCacheError, SyncError
from ...models import family_of, find
from ..layouts import layout_of, lookup
from ..rollout_protocol import SyncCheck
from ..weight_check import compare, expected_tensors, fingerprints


def _gemm_weight(module, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] weight the module's GEMM computes with: its GEMM applied to I_K, without bias, is W^T exactly."""
    k = module.weight.shape[1] if module.weight.numel() else module.input_size
    device = module.weight.device
    return module.quant_method.apply(module, torch.eye(k, dtype=dtype, device=device), None).t()


def _gemm_modules() -> tuple[type, ...]:
    """vLLM's modules that compute a GEMM through a quant method with their `weight` (linears, the vocabulary's
    embedding and head)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return LinearBase, VocabParallelEmbedding


def _gemms_read_a_copy() -> bool:
    """Whether a GEMM module reads another tensor than its `weight`: vLLM's CPU platform dispatches every unquantized
    GEMM at load (`dispatch_cpu_unquantized_gemm`), packing or dropping the weight; on CUDA the GEMM reads `weight`."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_tensors(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight of the engine's model by vLLM name, as the model computes with it (see the module docstring).
    A tied head appears under its own name (the logits GEMM) beside the embedding's (the lookup): `Family.tied_head`."""
    out: dict[str, torch.Tensor] = {}
    head = layout_of(model, "vllm").model["lm_head"] + "."
    seen: set[int] = set()
    gemms, packed = _gemm_modules(), _gemms_read_a_copy()
    with torch.inference_mode():
        for name, module in model.named_modules(remove_duplicate=False):
            if id(module) in seen and not (name + ".").startswith(head):
                continue  # one module under a second name (a MoE runner keeps the block's router as its `gate`)
            seen.add(id(module))
            for pname, param in module.named_parameters(recurse=False):
                full = f"{name}.{pname}" if name else pname
                lookup = type(module).__name__ == "VocabParallelEmbedding" and not full.startswith(head)
                if pname == "weight" and packed and isinstance(module, gemms) and not lookup:
                    out[full] = _gemm_weight(module, dtype)
                else:
                    out[full] = param.detach()
    return out


def expert_modules(model) -> list[tuple[str, torch.nn.Module, int]]:
    """(path, module, layer) of every MoE layer's experts module in the engine's model (the vLLM
    layout's `experts`); none for a dense family."""
    layout = layout_of(model, "vllm")
    experts = layout.experts
    if experts is None:
        return []
    prefix, role = layout.model["layers"], layout.layer[experts.module]
    return [(f"{prefix}.{i}.{role}", find(layer, role), i) for i, layer in enumerate(find(model, prefix))]


def expert_sources(model, trainer_layers: str) -> dict[str, str]:
    """Engine expert tensor -> the trainer tensor vLLM's MoE loader copies into it (`trainer_layers`: where the
    trainer keeps its decoder layers)."""
    experts = layout_of(model, "vllm").experts
    return {f"{path}.{param}": f"{trainer_layers}.{i}.{source}" for path, _, i in expert_modules(model)
            for param, source in experts.tensors.items()}


def _experts_kernel(module):
    """The experts kernel of one of vLLM's MoE modules (its post-load processing lays the weights out)."""
    kernel = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    if kernel is None or not callable(getattr(kernel, "process_weights_after_loading", None)):
        raise SyncError(f"weight sync: vLLM's {type(module).__name__} has no experts kernel where vLLM 0.32 keeps it "
                        "(quant_method.moe_kernel.fused_experts); use a supported vLLM version "
                        "(docs/reference/install.md, 'Supported versions')")
    return kernel


def kernel_layout(module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (parameter -> the trainer's tensor, in checkpoint layout) as the experts kernel of `module` lays them
    out after loading (on the CPU: zero-padded and prepacked into its tile order), computed on a stand-in module that
    holds copies, so the engine's own tensors are never touched or read."""
    stand_in = torch.nn.Module()
    for name, tensor in tensors.items():
        stand_in.register_parameter(name, torch.nn.Parameter(tensor.detach().clone(), requires_grad=False))
    for attr in ("moe_config", "activation"):  # what a kernel may read of its layer besides the weights
        if hasattr(module, attr):
            setattr(stand_in, attr, getattr(module, attr))
    _experts_kernel(module).process_weights_after_loading(stand_in)
    return {name: getattr(stand_in, name).detach() for name in tensors}


def storage(model) -> dict[str, int]:
    """Every parameter's storage address by name: what a captured CUDA graph reads."""
    return {name: p.data_ptr() for name, p in model.named_parameters(remove_duplicate=False)}


def moved_storage(before: dict[str, int], model) -> list[str]:
    """The parameters whose storage is not where `before` (`storage`) found it."""
    return [name for name, address in storage(model).items() if before.get(name) != address]


def _replays_graphs(llm) -> bool:
    """Whether the engine replays captured CUDA graphs (vLLM's cudagraph_mode other than NONE)."""
    mode = getattr(llm.llm_engine.vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


class WeightSession:
    """One weight sync on one in-process engine (`llm`: vllm.LLM; `model`: its nn.Module), from the engine as loaded to
    its last proven push: the push (`push`: the stale-cache probe's positive control, the reload, the cache reset),
    its proof on the device (`prove`), and the stale-cache probe that proves it fresh in the next engine call
    (`cache_probe`, or `prove_cache` alone). Built at the start of a sync: the probe is primed (its blocks cached) and,
    when the engine replays CUDA graphs, every parameter's address recorded."""

    def __init__(self, llm, model, tied: bool, vocab_size: int) -> None:
        self.llm, self.model, self.tied = llm, model, tied
        self.dtype = llm.llm_engine.vllm_config.model_config.dtype
        self.family, self.layout = family_of(model), layout_of(model, "vllm")
        self.packed = self.layout.packed  # what vLLM's loader stacks (its packed_modules_mapping)
        self.experts = expert_modules(model)  # a MoE's experts modules (its own loader), none when dense
        self.addresses = storage(model) if _replays_graphs(llm) else None  # what the captured graphs read
        self.previous: list[tuple[float, float]] = []  # each tensor's fingerprint at the previous check
        self.cache_probe = StaleCacheProbe(llm, vocab_size)
        self.cache_probe.prime()  # its blocks cached: every push's positive control, the first one's too

    def push(self, weights: Mapping[str, torch.Tensor]) -> float:
        """The positive control, then `weights` loaded and the prefix cache reset; the push stays unproven until an
        engine call scores the probe. Returns the seconds the positive control took."""
        if self.cache_probe.due:  # else this push's probe could not be told from the previous push's
            raise SyncError("stale-cache probe: a push before the previous push was proven (no engine call scored the "
                            "probe in between); run a rollout or prove_cache() after every push")
        t0 = time.perf_counter()
        self.cache_probe.expect_cached()  # positive control first: a missing reset below must be visible
        t_control = time.perf_counter() - t0
        self.load(weights.items())
        self.reset_cache()
        self.cache_probe.pushed()  # unproven until an engine call scores the probe, whatever `prove` says
        return t_control

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load `named` (the trainer's tensors by name) into the engine through vLLM's reload path, as a checkpoint
        saves them (a mixture of experts' fused parameters as per-expert tensors: Family.as_saved)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(self.family.as_saved(named))),
                                                          "is_checkpoint_format": True})
        head = find(self.model, self.layout.model["lm_head"])
        if self.tied and isinstance(head, _gemm_modules()):
            head.quant_method.process_weights_after_loading(head)  # the tied head's own GEMM copy (docstring)
        for _, module, _ in self.experts:  # the experts kernel's layout, which the reload skips (docstring)
            _experts_kernel(module).process_weights_after_loading(module)

    def reset_cache(self) -> None:
        """Drop every cached KV block: they were computed with the weights before the push."""
        if not self.llm.reset_prefix_cache():
            raise SyncError("vLLM refused to reset its prefix cache (requests still running); finish them before "
                            "pushing weights")

    def prove(self, trainer: Mapping[str, torch.Tensor], audit: bool = False) -> SyncCheck:
        """Raise SyncError naming the first engine tensor that is not the trainer's, compared on the device (and with
        `audit`, by sha256 on the host too); else counts."""
        held = engine_tensors(self.model, self.dtype)
        want = expected_tensors(trainer, held, self.packed, self.family.tied_head if self.tied else None,
                                expert_sources(self.model, lookup("hf", self.family.model_type).model["layers"]))
        for path, module, _ in self.experts:  # what the experts kernel computes with: its layout of those tensors
            names = [f"{path}.{param}" for param in self.layout.experts.tensors]
            laid_out = kernel_layout(module, {n.rpartition(".")[2]: want[n][0][1] for n in names})
            want |= {n: [(want[n][0][0], laid_out[n.rpartition(".")[2]])] for n in names}
        whole = compare(held, want, audit)
        moved = moved_storage(self.addresses, self.model) if self.addresses is not None else []
        if moved:
            raise SyncError(f"weight sync: the push gave the engine's {moved[0]} new storage, but its captured CUDA "
                            "graphs still read the old one, so it does not compute with the tensor the check compared; "
                            "push through vLLM's in-place reload, or run rl with --engine eager")
        now = fingerprints(whole)
        changed = sum(a != b for a, b in zip(now, self.previous)) if self.previous else 0
        self.previous = now
        return SyncCheck(tensors=len(now), changed=changed)

    def prove_cache(self) -> None:
        """The stale-cache probe scored alone: for a push no rollout follows."""
        self.cache_probe.check()


class StaleCacheProbe:
    """Scores a fixed prompt of a little over two KV blocks through the prefix cache, once per push (module docstring):
    in the next rollout's engine call (`request`, `verdict`) or alone (`check`). Call `prime()` once first: the probe
    prompt must have been scored (its blocks cached) before a check's push."""

    def __init__(self, llm, vocab_size: int, top_k: int = 20, seed: int = 0) -> None:
        self.llm = llm
        self.block = llm.llm_engine.vllm_config.cache_config.block_size
        g = torch.Generator().manual_seed(seed)
        # random tokens (not special ids 0-2): a prompt no rollout shares, whose first two blocks get cached
        self.token_ids = torch.randint(3, vocab_size, (2 * self.block + 3,), generator=g).tolist()
        self.top_k = top_k
        self.before: tuple | None = None
        self.due = False  # a push happened that no probe has scored since
        self.moved: bool | None = None  # the last verdict's: whether the score moved from the one before

    def request(self):
        """The probe as one more request of an engine call: (prompt, sampling params)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        return (TokensPrompt(prompt_token_ids=self.token_ids),
                SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.top_k, detokenize=False))

    def _score(self, out) -> tuple[tuple, int]:
        """The probe's greedy next token and top-k logprobs in `out` (its RequestOutput), and how many of its tokens
        vLLM served from the prefix cache."""
        cached = getattr(out, "num_cached_tokens", None)
        if cached is None:
            raise SyncError("stale-cache probe: this vLLM does not report RequestOutput.num_cached_tokens, so a stale "
                            "prefix cache cannot be detected; use a vLLM whose RequestOutput reports it (0.8 or later)")
        return tuple(sorted((tok, lp.logprob) for tok, lp in out.outputs[0].logprobs[0].items())), cached

    def _alone(self):
        prompt, params = self.request()
        [out] = self.llm.generate([prompt], [params], use_tqdm=False)
        return out

    def prime(self) -> None:
        """Score the probe alone so that its blocks are cached: the next push's positive control needs them. A push
        made before it goes unchecked by the probe (the score cached it)."""
        self.before, _ = self._score(self._alone())
        self.due = False

    def pushed(self) -> None:
        """A push and its cache reset happened: the next engine call must carry the probe (or `check` it alone)."""
        self.due = True

    def cached_tokens(self) -> int:
        """How many of the probe prompt's tokens the prefix cache would serve now, looked up as the scheduler looks up
        an arriving request (its block hashes in the block pool); no engine call, no state changed."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        try:
            core = self.llm.llm_engine.engine_core.engine_core
            manager, hasher = core.scheduler.kv_cache_manager, core.request_block_hasher
        except AttributeError as e:
            raise SyncError(f"stale-cache probe: cannot reach vLLM's in-process KV cache manager ({e}); run the engine "
                            "in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)") from None
        kwargs = dict(request_id="divergence-probe-stale-cache-control", prompt_token_ids=list(self.token_ids),
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None, block_hasher=hasher)
        if "eos_token_id" in inspect.signature(Request).parameters:  # older vLLMs take it (required, may be None)
            kwargs["eos_token_id"] = None
        try:
            return int(manager.get_computed_blocks(Request(**kwargs))[1])
        except (TypeError, AttributeError) as e:
            raise SyncError(f"stale-cache probe: this vLLM's prefix-cache lookup differs from the one rl knows ({e}); "
                            "use vLLM 0.32 (the version rl's positive control is written against)") from None

    def expect_cached(self) -> None:
        """Positive control, before a push: the probe's full blocks are in the prefix cache, so that a missing reset
        after the push would serve them (and the check would see it)."""
        want = (len(self.token_ids) - 1) // self.block * self.block  # vLLM recomputes the last token: full blocks
        have = self.cached_tokens()
        if have != want:
            raise SyncError(f"stale-cache probe: before the push only {have} of the probe prompt's {want} cacheable "
                            "tokens are in the prefix cache (evicted by the rollouts), so a missing cache reset could "
                            "not be seen; give the engine more KV cache memory (--engine-args)")

    def verdict(self, out) -> None:
        """The probe's output after a push and a cache reset (from a rollout's engine call or `check`): none of its
        tokens may have been served from the prefix cache, else StaleCacheError. Sets `moved`: whether the score moved
        from the previous one (reported, not required: a small update can leave every BF16 activation of the probe, and so
        its score, unchanged; that the engine computes with the new weights is what the comparison proves)."""
        self._require_primed()
        if list(out.prompt_token_ids) != self.token_ids:
            raise SyncError("stale-cache probe: the output scored as the probe is another request's; the engine "
                            "returned its outputs out of request order")
        now, cached = self._score(out)
        if cached != 0:
            raise StaleCacheError(f"stale prefix cache: after the weight push, {cached} of the probe prompt's "
                                  f"{len(self.token_ids)} tokens were served from KV cached with the previous "
                                  "weights; call llm.reset_prefix_cache() after every push")
        self.moved = now != self.before
        self.before = now  # its blocks, now cached, hold the current weights: the next check's positive control
        self.due = False

    def check(self) -> None:
        """`verdict` on the probe scored alone: for a push no rollout follows."""
        self._require_primed()  # before the engine call
        self.verdict(self._alone())

    def _require_primed(self) -> None:
        if self.before is None:
            raise SyncError("stale-cache probe: prime() it before the first check (the positive control needs the "
                            "probe's blocks cached)")
