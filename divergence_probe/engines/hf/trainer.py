"""The training stack: Hugging Face transformers, as an RL trainer runs it to recompute logprobs.

Each prompt runs alone (batch 1, no padding), with `AutoModelForCausalLM` in the run's dtype and the
configured attention implementation; logprobs are `log_softmax` of the FP32-upcast logits, the way
trainers compute the policy they differentiate.

Tap seams: the family's transformers layout (engines/hf/layouts.py; docs/numerics.md has the map): module outputs for
norms, projections and the decoder layer; `resid_mid` is the input of the post-attention norm; `swiglu` the
input of down_proj. `q_rope`, `k_rope` and `attn_core` have no module boundary, so while a capture runs the
model's attention function is wrapped through transformers' own AttentionInterface registry (and restored
after): the wrapper sees query/key after RoPE and the attention output before o_proj.

Every forward runs under the torch numerics state of a trainer process (`torch_state.trainer_numerics`: the global
flags as they were before vLLM was imported, the engine's restored after), and under `--train-sdpa`'s kernel. With
`--train-precision amp` the model is loaded in FP32 and every forward runs under torch.autocast to the run's dtype.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import replace
from typing import Callable, Iterator, Sequence

import torch

from .. import torch_state
from ...environment import to_device
from ...errors import ModelError, NumericsError, StackError, one_line
from ...numerics.metrics import token_logprobs
from ...models import family_of, find
from ..layouts import layout_of
from ...prompts import Prompt, padded_batches
from ...taps import ALL_TAPS, TapKey
from ...versions import broken_import
from ..protocol import (CAPTURED, Capabilities, PromptScores, RouteSource, SamplingSpec, ScoresSink, SequenceScores,
                        StackInfo, StackSettings, TapEmit, TapSink)
from .kernels import SHIPPED, get_kernels
from .policy import HFPolicy
from .replay import HFReplay
from ..hooks import HookSet, PatchConflict, arg, first_tensor


class HFStack(HFPolicy):
    def __init__(self) -> None:
        self.model = None
        self.settings: StackSettings | None = None
        self.sdpa_chosen: dict[str, list[str]] = {}  # forward kind -> SDPA kernels torch's dispatcher chose
        self._muted = False  # True while a replay runs inside a capture: its ops are not the forward's taps
        self._running: int | None = None  # the prompt id of the forward running now (routes_replayed reads it)
        self._replay_checks: list[tuple] = []  # the running forward's replayed layers: (layer, key, k, experts, bad)
        self.kernels = SHIPPED  # the kernel set the forward runs (--train-kernels; engines/hf/kernels/)
        self._kernel_patch = HookSet()  # its replacements, undone when the set changes or the stack closes

    @contextmanager
    def numerics(self, kind: str) -> Iterator[Callable[[], AbstractContextManager]]:
        """The trainer's torch state for a block of forwards of this kind. It yields `observed`, the context for the
        block's model forwards: in the first block of each kind it records the SDPA kernel chosen (a function mode
        that observes the dispatcher's choice and runs the same call). Only the forwards: the run loop reduces taps
        inside the block, between forwards, and torch.compile guards its graphs on the function-mode stack, so a
        mode there would compile the reduction again once it is gone."""
        torch_state.check_sdpa(self.settings.train_sdpa, self.settings.device, self.model.config._attn_implementation)
        choice = torch_state.SdpaChoice() if kind not in self.sdpa_chosen else None

        @contextmanager
        def observed(autocast: bool = True) -> Iterator[None]:  # autocast=False: a backward (torch: not under autocast)
            with choice if choice is not None else nullcontext(), self._precision() if autocast else nullcontext():
                yield

        with torch_state.trainer_numerics(self.settings.train_sdpa, isolated=self.settings.train_state == "isolated"):
            yield observed
        if choice is not None:
            self.sdpa_chosen.setdefault(kind, sorted(choice.chosen))

    def _precision(self) -> AbstractContextManager:
        """--train-precision amp: the forward under torch.autocast to the run's dtype over the FP32 model, as torch AMP
        and FSDP mixed precision run a trainer (GEMMs and attention in the run's dtype; what autocast leaves alone,
        the embedding, the residual adds, the norms and RoPE, in FP32). bf16: the model as loaded, in the run's dtype."""
        if self.settings.train_precision != "amp":
            return nullcontext()
        return torch.autocast(device_type=torch.device(self.settings.device).type, dtype=self.settings.dtype)

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 1) -> Capabilities:
        """Every tap by a hook on its module, patches in place, and the trainer's ops on another stack's inputs
        (replay, forward_from, lm_head) and its experts on another stack's routes (routes_replayed). As the inference
        side it has no other engine mode to measure against."""
        return Capabilities(taps={name: CAPTURED for name in ALL_TAPS}, grafts=True, replays_routes=True,
                            refused={"--engine-noise": f"--engine-noise measures vLLM's eager-vs-compiled gap, but "
                                                       f"--infer is {cls.name}; drop --engine-noise or use --infer vllm"})

    def capabilities(self) -> Capabilities:
        return self.declare()

    def begin_run(self) -> None:
        """Nothing of a run is kept between runs."""

    def load(self, settings: StackSettings) -> None:
        from transformers import AutoModelForCausalLM

        self.settings = settings
        if settings.train_attn == "flash_attention_2":  # say what is missing before a slow load fails on it
            from importlib.util import find_spec

            if torch.device(settings.device).type != "cuda":
                raise StackError(f"--train-attn flash_attention_2 needs a CUDA device (this run uses "
                                 f"{settings.device}); use --train-attn sdpa or eager")
            if find_spec("flash_attn") is None:
                raise StackError("--train-attn flash_attention_2 needs the flash-attn package, which is not installed; "
                                 "`pip install flash-attn --no-build-isolation` on the CUDA machine, or use --train-attn sdpa")
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                settings.model_path, dtype=torch.float32 if settings.train_precision == "amp" else settings.dtype,
                attn_implementation=settings.train_attn,
                **({"experts_implementation": settings.train_experts} if settings.train_experts else {}),
                output_loading_info=True,
            )
        except (OSError, ValueError, ImportError, RuntimeError) as e:  # RuntimeError: shape mismatches
            # a library transformers imports for the model that fails to import is named, not the checkpoint
            raise (broken_import(e)
                   or ModelError(f"transformers could not load {settings.model_path}: {one_line(e)}")) from e
        # Second line of defence behind model_source's checks: transformers' own report of what it did not load.
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            if info.get(kind):
                first = sorted(info[kind], key=str)[0]
                raise ModelError(f"transformers reports {kind.replace('_', ' ')} loading {settings.model_path} (first: "
                                 f"{first}); the checkpoint does not match its config.json: re-export it")
        self.model = model.to(settings.device).eval()
        bad = [n for n, p in self.model.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise NumericsError(
                f"the checkpoint has NaN/Inf weights in {len(bad)} tensor(s), first: {bad[0]}; "
                "the model is broken, re-export or re-download it"
            )
        self._use_kernels(settings.train_kernels)

    def _use_kernels(self, name: str) -> None:
        """Run the forward on the kernel set `name`, in place of the one it runs now (planned in full first: a
        target the set cannot find raises before anything changed)."""
        if name == self.kernels:
            return
        found = [replace(r, owner=f"--train-kernels {name}") for r in get_kernels(name).plan(self.model)]
        self._kernel_patch.remove()
        self.kernels = SHIPPED
        self._kernel_patch.apply(found)
        self.kernels = name

    def layers_aligned(self, layers, regions) -> list:
        """The replacements that align `regions` in the decoder layers `layers` alone, every other layer as shipped
        (remedies' fp32_layers arm; patches/layers.py), for the caller's HookSet."""
        from .patches.layers import patch

        return patch(self.model, layers, regions)

    @contextmanager
    def kernels_used(self, name: str) -> Iterator[None]:
        """The forwards of this block on the kernel set `name` (ablate's train:kernels factor); the set the stack was
        loaded with again after it."""
        loaded = self.kernels
        self._use_kernels(name)
        try:
            yield
        finally:
            self._use_kernels(loaded)

    @property
    def layers(self):
        return self._module("layers")

    def score(self, prompts: Sequence[Prompt], taps: frozenset[str], sink: TapSink,
              on_scored: ScoresSink | None = None) -> list[PromptScores]:
        """One forward per prompt under one capture: installing ~300 hooks costs the host about as much as
        running them, so they are installed once per call, not once per prompt."""
        results: list[PromptScores] = []
        deliver = on_scored or results.append
        prompt = None  # the prompt running now: the hooks file its taps under its id

        def emit(key: TapKey, x: torch.Tensor) -> None:
            if not self._muted:
                sink(prompt.prompt_id, key, x)

        with torch.inference_mode(), self.numerics("score") as observed, self.capture(taps, emit):
            for prompt in prompts:
                ids = to_device(torch.tensor([prompt.token_ids]), self.settings.device)
                positions = torch.arange(ids.shape[1], device=ids.device)[None]
                with self.running(prompt.prompt_id), observed():
                    logits = self.model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, :-1]
                deliver(PromptScores(prompt.prompt_id, logits, token_logprobs(logits, ids[0, 1:])))
        return results

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *,
                routes: RouteSource | None = None) -> torch.Tensor:
        """The training forward of one right-padded batch (protocol.Trainer): logits [B, L, V], differentiable. A
        capture the caller installed runs first, then the replay of `routes` (the batch is key 0 of `running`)."""
        with ExitStack() as scope:
            if routes is not None:
                scope.enter_context(self.routes_replayed(routes))
                scope.enter_context(self.running(0))
            observed = scope.enter_context(self.numerics("train"))
            scope.enter_context(observed())
            return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits

    @contextmanager
    def running(self, key: int) -> Iterator[None]:
        """The model forwards of this block are those of `key` (a prompt, or a trainer's batch): what a replay's
        `routes(key, layer)` is asked for. At the block's end the replay's row checks of every layer are read back
        at once (`_check_replayed`)."""
        self._running, self._replay_checks = key, []
        try:
            yield
            self._check_replayed()
        finally:
            self._running, self._replay_checks = None, []

    def _check_replayed(self) -> None:
        """Refuse the routes a replay ran with when a layer's were not k distinct experts in every row: the verdicts
        every layer's hook left on the device, read back with one host sync per forward instead of one per layer (a
        sync stalls the host until the device has caught up, so L of them per forward serialise a trainer's step)."""
        if not self._replay_checks:
            return
        bad = torch.stack([check[-1] for check in self._replay_checks]).tolist()  # the forward's one read-back
        for (layer, key, k, experts, _), refused in zip(self._replay_checks, bad):
            if refused:
                raise StackError(f"the engine's routes of layer {layer} for prompt {key} are not {k} distinct experts "
                                 f"of {experts} in every row, so there is nothing to replay; report this as a bug")

    @contextmanager
    def routes_replayed(self, routes: RouteSource) -> Iterator[None]:
        """Every mixture-of-experts layer's experts run with the experts `routes(prompt_id, layer)` names for the prompt
        being scored, instead of the trainer's own top-k: routing replay (R3, as verl's router_replay and Megatron's
        RouterReplay do it in a trainer). `routes` returns (ids [T, k], weights [T, k] or None) for the router's rows
        (a batch's flattened rows; the last row may be missing, and rows of ids -1 keep the trainer's own choice: a
        sampled sequence's last token, which the engine never ran, and padding). Weights None: the
        trainer's own gate weights for those experts, computed as transformers' router computes them for its own pick
        (FP32 softmax of its logits over every expert, taken at the ids, renormalised where norm_topk_prob, cast to
        the logits' dtype), so replaying the trainer's own top-k changes nothing, bit for bit. Given weights: the
        engine's, cast to that dtype (the replay of ids and weights). The router's logits are left as they are: the
        router_logits tap and the routing metrics still show the disagreement the replay hides."""
        family = family_of(self.model)
        if family.top_k_field is None:
            raise StackError(f"routing replay needs a mixture-of-experts model; {family.model_type} has no router")
        hooks = HookSet()
        for i, layer in enumerate(self.layers):
            hooks.after(find(layer, layout_of(self.model, "hf").layer["gate"]), self._replay_hook(i, routes))
        with hooks:
            yield

    def _replay_hook(self, layer: int, routes: RouteSource):
        def hook(module, args, kwargs, output):
            if self._running is None or self._muted:
                return None  # a forward outside score(): nothing to replay for it
            if not (isinstance(output, tuple) and len(output) == 3):
                raise StackError(f"transformers' router of layer {layer} returned {type(output).__name__}, not (logits, "
                                 "weights, ids): its modeling code changed; routing replay needs a supported "
                                 "transformers version (docs/reference/install.md, 'Supported versions')")
            logits, own_weights, own_ids = output
            ids, weights = routes(self._running, layer)
            n = ids.shape[0]
            if ids.shape[1:] != own_ids.shape[1:] or not own_ids.shape[0] - 1 <= n <= own_ids.shape[0]:
                raise StackError(f"the replayed routes of layer {layer} are {tuple(ids.shape)} for a router output of "
                                 f"{tuple(own_ids.shape)} (prompt {self._running}); report this as a bug")
            ids = ids.to(device=logits.device, dtype=own_ids.dtype)
            if n < own_ids.shape[0]:  # a sampled sequence's last token, which the engine never ran: it scores nothing
                ids = torch.cat([ids, torch.full_like(own_ids[n:], -1)])
                weights = None if weights is None else torch.cat([weights.to(logits.device), own_weights[n:]])
            own = (ids < 0).any(dim=-1, keepdim=True)  # rows the engine has no route for keep the trainer's own
            ids = torch.where(own, own_ids, ids)
            picked = ids.sort(dim=-1).values  # every row k distinct experts: a zeroed or torn record is not a route
            bad = ((picked[:, 0] < 0) | (picked[:, -1] >= logits.shape[-1])
                   | (picked[:, 1:] == picked[:, :-1]).any(dim=-1))[:, None]
            # judged once per forward, on the host (`running`); until then such rows run the trainer's own experts,
            # so no expert index is out of range, and the forward's result is refused whole
            self._replay_checks.append((layer, self._running, ids.shape[-1], logits.shape[-1], bad.any()))
            ids = torch.where(bad, own_ids, ids)
            own = own | bad
            if weights is None:
                weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
                if module.norm_topk_prob:
                    weights = weights / weights.sum(dim=-1, keepdim=True)
            weights = torch.where(own, own_weights, weights.to(device=logits.device, dtype=logits.dtype))
            return logits, weights, ids

        return hook

    def score_batched(self, prompts: Sequence[Prompt], taps: frozenset[str] = frozenset(),
                      sink: TapSink | None = None) -> list[PromptScores]:
        """The prompts in right-padded micro-batches of at most --batch-tokens padded tokens (attention mask, positions
        from 0 per row): how a trainer batches sequences of different lengths, within the memory the plan gave the
        trainer's forward. `taps`: only those read as rows of the flattened batch (a router's logits and ids), handed to
        `sink` per prompt without the padding rows."""
        return [s for group in self.batch_groups(prompts) for s in self._score_padded(group, taps, sink)]

    def batch_groups(self, prompts: Sequence[Prompt]) -> list[list[Prompt]]:
        """How score_batched groups prompts into forwards."""
        return list(padded_batches(prompts, self.settings.batch_tokens))

    def _score_padded(self, prompts: Sequence[Prompt], taps: frozenset[str], sink: TapSink | None):
        pad = self.model.generation_config.pad_token_id or 0
        longest = max(len(p.token_ids) for p in prompts)
        ids = torch.full((len(prompts), longest), pad, device=self.settings.device)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, : len(p.token_ids)] = torch.tensor(p.token_ids)
            mask[row, : len(p.token_ids)] = 1
        positions = torch.arange(longest, device=ids.device)[None].expand_as(ids)
        # a router flattens the batch: its logits and its choice (the ids it returned) are rows of the flattened batch
        rows_read = {t for seam in layout_of(self.model, "hf").seams if seam.read in ("rows", "router_choice")
                     for t in seam.taps}
        if not taps <= rows_read:
            raise StackError(f"a batched transformers forward captures only {', '.join(sorted(rows_read)) or 'no'} "
                             f"taps, not {', '.join(sorted(taps - rows_read))}")

        def emit(key: TapKey, x: torch.Tensor) -> None:  # [batch * longest, features] -> each prompt's own rows
            for row, p in enumerate(prompts):
                sink(p.prompt_id, key, x.view(len(prompts), longest, -1)[row, : len(p.token_ids)])

        with torch.inference_mode(), self.numerics("score_batched") as observed, self.capture(taps, emit), \
                observed():
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        results = []
        for row, p in enumerate(prompts):
            n = len(p.token_ids)
            results.append(PromptScores(p.prompt_id, logits[row, : n - 1], token_logprobs(logits[row, : n - 1], ids[row, 1:n])))
        return results

    def sample(self, prompts: Sequence[Prompt], spec: SamplingSpec, taps: frozenset[str], sink: TapSink) -> list[SequenceScores]:
        """Sample with transformers' generate, then score each whole sequence in one forward, exactly as the
        training side does: on the inference side this makes generate mode's honest zero baseline."""
        results = []
        for prompt in prompts:
            for k in range(spec.samples_per_prompt):
                ids = torch.tensor([prompt.token_ids], device=self.settings.device)
                with torch.random.fork_rng(devices=[]), torch.inference_mode(), self.numerics("generate") as observed, \
                        observed():
                    torch.manual_seed(spec.request_seed(prompt.prompt_id, k))
                    out = self.model.generate(
                        ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec.max_new_tokens,
                        do_sample=spec.temperature > 0, temperature=spec.temperature or None, top_p=spec.top_p,
                        top_k=0, pad_token_id=self.model.generation_config.pad_token_id,
                    )
                tokens = tuple(out[0].tolist())
                seq_id = len(results)
                fed = len(tokens) - 1  # like an engine, which never feeds its last sample back

                def trimmed(sid, key, x, fed=fed):
                    sink(sid, key, x[:fed])

                [scored] = self.score([replace(prompt, prompt_id=seq_id, token_ids=tokens)], taps, trimmed)
                results.append(SequenceScores(seq_id, prompt.prompt_id, k, tokens, len(prompt.token_ids),
                                              scored.logits, scored.logprobs))
        return results

    @contextmanager
    def _replaying(self) -> Iterator[None]:
        """A graft's ops: under the trainer's numerics, and silent to a capture that may be installed (a replay runs
        while compare's training forward is still capturing, between two sequences)."""
        muted, self._muted = self._muted, True
        try:
            with torch.inference_mode(), self.numerics("replay") as observed, observed():
                yield
        finally:
            self._muted = muted

    def replay(self, taps: dict[TapKey, torch.Tensor]) -> dict[TapKey, torch.Tensor]:
        """This stack's op at every seam, run on another stack's captured inputs (one sequence): hf_replay.py."""
        with self._replaying():
            return HFReplay(self.model).replay(taps)

    def forward_from(self, start: int, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The rest of this stack's forward from another stack's residual stream entering layer `start`: logits."""
        with self._replaying():
            return HFReplay(self.model).forward_from(start, hidden, embeds)

    def lm_head(self, final_norm: torch.Tensor) -> torch.Tensor:
        """This stack's lm_head on another stack's final-norm output: [T, V] logits."""
        with self._replaying():
            return HFReplay(self.model).lm_head(final_norm)

    def capture(self, taps: frozenset[str], emit: TapEmit) -> HookSet:
        """Install the captures for the selected taps; each hands a [tokens, features] view to emit (no copy:
        transformers' Qwen2/Qwen3 and our region patches never write an activation in place).

        The projections (seams read "projection", half of a layer's taps) are captured by a wrapper in place of their
        forward: a module with hooks takes torch's slow call path, which costs the host several times what the hook
        itself does, for every tap of every forward. The norms and the layer keep hooks: regions replace their
        forwards."""
        hooks = HookSet()
        if not taps:
            return hooks
        try:
            self._install(hooks, taps, emit)
        except PatchConflict:
            hooks.remove()  # what was installed so far: the caller never gets the HookSet to undo it
            raise
        return hooks

    def _install(self, hooks: HookSet, taps: frozenset[str], emit) -> None:
        """The family's transformers seams (engines/hf/layouts.py), each read as its kind says: a module's output or
        input (hooks), a projection's input or output (its forward wrapped), or the attention function
        (`_wrap_attention`)."""
        n_layers = len(self.layers)
        family, layout = family_of(self.model), layout_of(self.model, "hf")

        def out(name: str, layer: int, reshape=lambda x: x[0]):
            key = TapKey.of(name, layer)
            return lambda m, a, k, o: emit(key, reshape(first_tensor(o)))

        def inp(name: str, layer: int, at: tuple[int, str]):
            key = TapKey.of(name, layer)
            return lambda m, a, k: emit(key, arg(a, k, *at)[0])

        def heads(x):  # [1, T, heads, d] -> [T, heads*d]
            return x[0].reshape(x.shape[1], -1)

        if "embed" in taps:
            hooks.after(self._module("embed"), out("embed", -1))
        for i, layer in enumerate(self.layers):
            projections: dict[str, list] = {}  # role -> [tap of its input, tap of its output, where its input is]
            for seam in layout.seams:
                if seam.read == "attention" or not taps & set(seam.taps):
                    continue
                module = find(layer, layout.layer[seam.module]) if seam.module else layer
                if seam.read == "router_choice":  # a router's (logits, weights, ids): the experts it picked
                    hooks.after(module, _router_choice(seam.taps, taps, i, emit))
                    continue
                [name] = seam.taps
                if seam.read == "output":
                    hooks.after(module, out(name, i))
                elif seam.read == "rows":  # already [tokens, features]: a router flattens the batch
                    hooks.after(module, out(name, i, lambda x: x))
                elif seam.read == "heads":
                    hooks.after(module, out(name, i, heads))
                elif seam.read == "input":
                    hooks.before(module, inp(name, i, seam.arg))
                elif seam.read in ("projection", "projection_input"):
                    wrap = projections.setdefault(seam.module, [None, None, (0, "input")])
                    wrap[seam.read == "projection"] = TapKey.of(name, i)
                    wrap[2] = seam.arg or wrap[2]
                else:
                    raise ValueError(f"{family.model_type}: transformers seam read {seam.read!r} is not one "
                                     "engines/hf/trainer.py knows")
            for role, (before, after, at) in projections.items():
                _wrap_projection(hooks, find(layer, layout.layer[role]), before, after, emit, at)
        if "final_norm" in taps:
            hooks.after(self._module("final_norm"), out("final_norm", n_layers))
        if "logits" in taps:  # scored rows only: the last position predicts a token that is not in the prompt
            hooks.after(self._module("lm_head"), out("logits", n_layers, lambda x: x[0, :-1]))
        if taps & {"q_rope", "k_rope", "attn_core"}:
            self._wrap_attention(hooks, taps, emit)

    def _module(self, role: str):
        """A model-level module of the family by role (engines/hf/layouts.py: embed, layers, final_norm, lm_head)."""
        return find(self.model, layout_of(self.model, "hf").model[role])

    def _wrap_attention(self, hooks: HookSet, taps: frozenset[str], emit) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        impl = self.model.config._attn_implementation
        registry = ALL_ATTENTION_FUNCTIONS
        if impl == "eager":
            from importlib import import_module

            inner = import_module(type(self.model).__module__).eager_attention_forward
        else:
            inner = registry[impl]
        names = [name for name in ("q_rope", "k_rope", "attn_core") if name in taps]
        attn = layout_of(self.model, "hf").layer["attn"]
        keys_of = {id(find(layer, attn)): {n: TapKey.of(n, i) for n in names} for i, layer in enumerate(self.layers)}

        def tapped(module, query, key, value, attention_mask, **kwargs):
            result = inner(module, query, key, value, attention_mask, **kwargs)
            keys = keys_of.get(id(module))
            if keys is not None:  # [1, heads, T, d] -> [T, heads*d]
                if "q_rope" in keys:
                    emit(keys["q_rope"], query[0].transpose(0, 1).reshape(query.shape[2], -1))
                if "k_rope" in keys:
                    emit(keys["k_rope"], key[0].transpose(0, 1).reshape(key.shape[2], -1))
                if "attn_core" in keys:  # [1, T, heads, d] -> [T, heads*d]
                    core = result[0]
                    emit(keys["attn_core"], core[0].reshape(core.shape[1], -1))
            return result

        # registry[impl] = ... writes the registry's local mapping; replacing that entry through the HookSet makes
        # a second swap (another capture, a region that replaces attention) a PatchConflict, not a silent wrap.
        hooks.replace_item(registry._local_mapping, impl, tapped, label="ALL_ATTENTION_FUNCTIONS",
                           owner="the attention taps of a transformers capture")

    def info(self) -> StackInfo:
        import transformers

        layer, roles = self.layers[0], layout_of(self.model, "hf").layer
        moe = family_of(self.model).top_k_field is not None  # the experts' implementation, not a dense SwiGLU
        attn_module = type(find(layer, roles["attn"])).__module__
        mlp = find(layer, roles["mlp"])
        return StackInfo(
            name=self.name,
            versions={"transformers": transformers.__version__, "torch": torch.__version__},
            implementations={
                "rmsnorm": f"{type(find(layer, roles['input_norm'])).__qualname__}.forward",
                "rope": f"{attn_module}.apply_rotary_pos_emb",
                **({"experts": getattr(self.model.config, "_experts_implementation", None) or "transformers' default"}
                   if moe else
                   {"swiglu": f"{type(mlp).__qualname__}.forward (act_fn={type(find(layer, roles['act'])).__name__})"}),
                "attention": self.model.config._attn_implementation,
            },
            settings={
                "batch": "one prompt per forward, no padding",
                "device": self.settings.device,
                "train_sdpa": self.settings.train_sdpa,
                # as torch._fused_sdp_choice reports for the first forward of each kind; "flash_attention" on the CPU
                # is torch's own CPU flash kernel; empty: no SDPA call (another attention implementation)
                "sdpa_kernel_chosen": dict(self.sdpa_chosen),
                "train_state": self.settings.train_state,
                **({"train_kernels": f"{self.kernels}: {get_kernels(self.kernels).summary}"}
                   if self.kernels != SHIPPED else {}),
                "train_precision": "amp: FP32 master weights, forward under torch.autocast to "
                                   f"{str(self.settings.dtype).removeprefix('torch.')}" if self.settings.train_precision
                                   == "amp" else f"weights and compute in {str(self.settings.dtype).removeprefix('torch.')}",
                "torch_numerics": torch_state.describe(torch_state.trainer_state() if self.settings.train_state ==
                                                       "isolated" else torch_state.capture()),
                "torch_numerics_snapshot": torch_state.origin() if self.settings.train_state == "isolated" else
                "inherited: the state vLLM left in this process",
            },
        )

    def close(self) -> None:
        self._kernel_patch.remove()
        self.kernels = SHIPPED
        self.model = None


def _wrap_projection(hooks: HookSet, module: torch.nn.Module, before: TapKey | None, after: TapKey | None, emit,
                     at: tuple[int, str] = (0, "input")) -> None:
    """`module.forward` replaced, until the HookSet exits, by one that emits its input (argument `at`: position,
    keyword) as `before` and its output as `after` (either may be None): [1, T, F] -> [T, F]."""
    inner = module.forward

    def forward(*args, **kwargs):
        if before is not None:
            emit(before, arg(args, kwargs, *at)[0])
        output = inner(*args, **kwargs)
        if after is not None:
            emit(after, output[0])
        return output

    hooks.replace(module, "forward", forward, owner="the projection taps of a transformers capture")


def _router_choice(names: tuple[str, ...], taps: frozenset[str], layer: int, emit):
    """A hook emitting a router's choice, elements 1.. of its (logits, weights, ids) output, as the named records."""
    keys = [(i, TapKey.of(name, layer)) for i, name in enumerate(names, start=1) if name in taps]

    def hook(module, args, kwargs, output) -> None:
        for i, key in keys:
            emit(key, output[i])

    return hook
