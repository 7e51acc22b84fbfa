"""The inference stack: vLLM, in-process, as an RL framework runs it to sample rollouts and score prompts.

Engine settings and why:
- `VLLM_ENABLE_V1_MULTIPROCESSING=0`: the engine core lives in this process, so hooks can reach the model.
- Two engine modes. `eager` (`enforce_eager=True`, prefix caching and chunked prefill off): no torch.compile and no
  CUDA graphs, so a module hook fires on every op and every layer can be tapped. `compiled`: vLLM's own defaults for
  `LLM(...)`, what RL frameworks run (Inductor, custom ops off, CUDA graphs on CUDA); the decoder stack then runs as
  one compiled graph in which no module hook fires, so without tap points only what crosses the graph's boundary is
  captured: its input ids, its output (the final norm) and the logits, computed after it. With tap points (asked for
  at load, part of the engine key) the graph itself copies the layer taps it materialises into static buffers,
  which CUDA graphs replay too, and the host reads them after each step (compiled_taps.py). `--engine-args` go to `LLM(...)` as
  given; the few that would make capture wrong are refused up front (`check_engine_args`).
- The step layout (input ids) and the final hidden states are read at the runner's call of the model
  (`_model_forward`), outside any compiled graph or CUDA-graph wrapper, so both modes share one seam.
- prefix caching: a cached prefix is never recomputed, so its logits and taps would silently be missing. Every
  request asks for prompt logprobs and sets `skip_reading_prefix_cache`, which vLLM sets itself for such requests:
  prompt tokens are always computed, whatever the engine's prefix caching setting.
- one step per batch: every prompt is prefilled whole, so the step's flattened token
  rows map back to (prompt, position) by matching the token ids (the GPU runner reorders requests).
- `prompt_logprobs=0`: vLLM reports the logprob of every actual prompt token itself (the raw, untempered
  log_softmax over FP32 logits); we also capture the logits it computed them from, for the full-vocab KL.

vLLM's CPU backend cannot host two engines in one process (the second one crashes with an illegal
instruction on these machines), so one engine is kept per process and reused for identical settings.

Tap seams (vLLM 0.24 CUDA / 0.32 CPU, Qwen2/Qwen3; docs/numerics.md has the map): norms return
`(normed, residual)` when fused with the residual add, and write both in place, so a tap whose buffer a later
op overwrites is cloned at capture (once per engine step, step.py `REWRITTEN`); `q_rope`/`k_rope` are the query/key
arguments of the `Attention` module; `resid_out` is formed as R(float(mlp_out) + float(residual)), which is
exactly what the next layer's fused add+norm computes.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import replace
from typing import Iterator, Sequence

import torch

from .. import torch_state
from ... import timings
from ...errors import StackError, one_line
from ...models import family_of, find
from ..layouts import layout_of
from ...prompts import Prompt, batches
from ...taps import ALL_TAPS, ROUTE_RECORDS, TapKey
from . import compiled_taps
from ..protocol import (CAPTURED, PATCH_AT_BUILD, PATCH_ONCE_LOADED, Capabilities, PromptScores, SamplingSpec,
                        ScoresSink, SequenceScores, StackInfo, StackSettings, TapSink)
from ..hooks import HookSet, after_call, arg, first_tensor
from ..rollout_protocol import Rolled, RolloutSample, SyncCheck
from .policy import VLLMPolicy
from .args import _import_vllm, _skips_prefix_cache, check_engine_args
from .knobs import tap_meanings
from .rollout import RolloutRecorder
from .weights import WeightSession
from .seams import decoder_layers, model_seams
from .engine_start import (_building, _disable_flashinfer_sampler_if_missing, _engine_key, _engine_kwargs,
                           _find_runner, _remove_dist_files, _tap_points, _track_dist_files)
from .step import _Step

SUPPORTED_MODEL_CLASSES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

_ENGINE: dict = {}  # the one live engine of this process: {"key": _engine_key(settings), "llm": LLM, "tap_points":
# compiled_taps.TapPoints of a compiled engine, else None}
_GRAFT_COMPILED = ("--graft/--depth need every layer tap of the engine, which a compiled engine does not expose; use "
                   "--engine eager")
COMPILED_REFUSED = {  # what a compiled engine cannot do, each in the one line that refuses it
    "--graft": _GRAFT_COMPILED,
    "--depth": _GRAFT_COMPILED,
    PATCH_ONCE_LOADED: "a compiled engine cannot take a region patch once built; align it through a run (compare "
                       "--align / ablate build an engine with the patch in a worker process) or use --engine eager",
}


class VLLMStack(VLLMPolicy):

    def __init__(self) -> None:
        self.llm = self.runner = self.model = None
        self.tap_points: compiled_taps.TapPoints | None = None  # a compiled engine's (the engine owns them)
        self.settings: StackSettings | None = None
        self.recompute_gap = 0.0  # max |our log_softmax of captured logits - vLLM's reported logprob|
        self.weight_session: WeightSession | None = None  # an RL loop's weight sync, from start_weight_sync on

    def load(self, settings: StackSettings) -> None:
        with timings.timed("load.infer.import_vllm"):
            vllm = _import_vllm()
        self.settings = settings
        key = _engine_key(settings)
        if _ENGINE and _ENGINE["key"] != key:
            raise StackError(
                "a vLLM engine with other settings is already running in this process, and vLLM's CPU backend "
                "cannot host a second one; run the other model, dtype, engine mode or tap points in a new process"
            )
        if not _ENGINE:
            with timings.timed("load.infer.check_engine_args"):
                check_engine_args(settings.engine_kwargs(), settings.engine)
            if settings.device == "cuda":
                _disable_flashinfer_sampler_if_missing()
            _track_dist_files()
            tap_points = compiled_taps.TapPoints().live() if settings.engine == "compiled" else None
            with contextlib.ExitStack() as failed:  # an engine that did not start leaves no tap points live
                if tap_points is not None:
                    failed.callback(tap_points.close)
                try:
                    with warnings.catch_warnings(), _building(settings, tap_points):
                        warnings.simplefilter("ignore", FutureWarning)
                        with timings.timed("load.infer.engine_start"):
                            llm = vllm.LLM(**_engine_kwargs(settings))
                except Exception as e:  # vLLM raises many types at start-up; all mean "this engine cannot start"
                    _remove_dist_files()
                    raise StackError(f"vLLM could not start on {settings.model_path}: {type(e).__name__}: "
                                     f"{one_line(e)}") from e
                failed.pop_all()
            _ENGINE.update(key=key, llm=llm, tap_points=tap_points)
        self.llm, self.tap_points = _ENGINE["llm"], _ENGINE["tap_points"]
        self._attach()

    def _attach(self, runner=None) -> None:
        """Reach the model through its runner: this process's (load), or a tensor-parallel rank's (tensor_parallel.py)."""
        self.runner = runner if runner is not None else _find_runner(self.llm)
        # the nn.Module itself: with CUDA graphs the runner holds it inside a wrapper that is no module
        self.model = self.runner.get_model() if callable(getattr(self.runner, "get_model", None)) else self.runner.model
        if type(self.model).__name__ not in SUPPORTED_MODEL_CLASSES:
            raise StackError(f"vLLM loaded {type(self.model).__name__}; supported: {', '.join(SUPPORTED_MODEL_CLASSES)}")
        if _tap_points(self.settings) & {"router_logits", *ROUTE_RECORDS}:
            compiled_taps.check_routes(self.model)

    @property
    def compiled(self) -> bool:
        return self.settings.engine == "compiled"

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 1) -> Capabilities:
        """Eager: every module runs as Python, so every tap is read by a hook and a region patch takes effect once
        loaded. Compiled: the taps Inductor never writes are refused (compiled_taps.REFUSED), and regions are traced
        into an engine built with them (runs/engine_align.py builds one in a worker process)."""
        if engine != "compiled":
            return Capabilities(taps={name: CAPTURED for name in ALL_TAPS}, records_routes=True)
        return Capabilities(taps=compiled_taps.declared(), refused=COMPILED_REFUSED, patch=PATCH_AT_BUILD,
                            records_routes=True)

    def capabilities(self) -> Capabilities:
        """A compiled engine's taps as built: those it has tap points for (the family's layers, its route records)."""
        declared = self.declare(self.settings.engine, self._ranks())
        taps = compiled_taps.status(taps_built=self.tap_points.built, family=family_of(self.model)) if self.compiled \
            else declared.taps
        return replace(declared, taps=taps, max_sequences_per_step=self.max_sequences_per_step,
                       tap_meanings=tap_meanings(self.settings.engine_kwargs()))

    def begin_run(self) -> None:
        self.recompute_gap = 0.0

    def _ranks(self) -> int:
        """The processes the engine's model lives in: this one."""
        return 1

    def _check_taps(self, taps: frozenset[str]) -> None:
        status = self.capabilities().taps
        missing = sorted(n for n in taps if status.get(n, "captured") != "captured")
        if missing:
            why = status[missing[0]].removeprefix("not captured")
            raise StackError(f"taps {', '.join(missing)} cannot be captured{why}")

    def _on_model_call(self, hooks: HookSet, before, after) -> None:
        """before(input_ids) and after(hidden_states) around each engine step's model call, outside any compiled
        graph: the runner's `_model_forward` (vLLM's v1 runner; with full CUDA graphs the model's own forward does not
        run on replay), else hooks on the model module (runners without that method). A compiled engine's layer taps
        are read there too, after the model call: the step's input rows of each tap buffer (TapPoints.deliver;
        padded rows of a CUDA-graph size come along, as in eager mode, and the layout code drops them)."""
        runner = self.runner
        original = getattr(runner, "_model_forward", None)
        step_ids = []

        def begin(input_ids):
            step_ids[:] = [input_ids]
            before(input_ids)

        def end(hidden):
            after(hidden)
            if self.compiled:
                self.tap_points.deliver(step_ids[0])

        if callable(original):
            def model_forward(*args, **kwargs):
                begin(kwargs["input_ids"] if "input_ids" in kwargs else args[0])
                output = original(*args, **kwargs)
                end(first_tensor(output))  # a tuple only with EAGLE-3 aux hidden states
                return output

            hooks.replace(runner, "_model_forward", model_forward)
        else:
            hooks.before(self.model, lambda m, a, k: begin(arg(a, k, 0, "input_ids")))
            hooks.after(self.model, lambda m, a, k, o: end(first_tensor(o)))

    def _params(self, **kwargs):
        from vllm import SamplingParams

        if _skips_prefix_cache(sys.modules["vllm"]):
            kwargs["skip_reading_prefix_cache"] = True  # every prompt token computed, prefix caching or not
        return SamplingParams(**kwargs)

    @property
    def max_sequences_per_step(self) -> int:
        """The most requests vLLM schedules in one step (`max_num_seqs`): a larger batch would be split."""
        return self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs

    @property
    def layers(self):
        return decoder_layers(self.model)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def score(self, prompts: Sequence[Prompt], taps: frozenset[str], sink: TapSink,
              on_scored: ScoresSink | None = None) -> list[PromptScores]:
        from vllm.inputs import TokensPrompt

        self._check_taps(taps)
        params = self._params(max_tokens=1, prompt_logprobs=0, detokenize=False, seed=self.settings.seed)
        requests = [TokensPrompt(prompt_token_ids=list(p.token_ids)) for p in prompts]
        outputs, logits_of = self._run_step(prompts, taps, sink, requests, params)
        results: list[PromptScores] = []
        deliver = on_scored or results.append
        for prompt, output in zip(prompts, outputs):
            reported = [entry[tok].logprob for entry, tok in zip(output.prompt_logprobs[1:], prompt.token_ids[1:])]
            logits = logits_of(prompt.prompt_id, len(prompt.token_ids))
            if "logits" in taps:
                sink(prompt.prompt_id, TapKey.of("logits", self.num_layers), logits)
            reported = torch.tensor(reported, dtype=torch.float32)
            self._check_logits(logits, prompt.token_ids, reported, f"prompt {prompt.prompt_id}")
            deliver(PromptScores(prompt.prompt_id, logits, reported))
        return results

    def _run_step(self, prompts: Sequence[Prompt], taps: frozenset[str], sink: TapSink, requests, params):
        """One engine step of these requests with the capture on: vLLM's outputs, and the captured logits by
        (prompt_id, length)."""
        step = _Step()
        with torch.inference_mode(), self._capture(prompts, taps, sink, step):
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        return outputs, step.logits

    def score_batched(self, prompts: Sequence[Prompt], taps: frozenset[str] = frozenset(),
                      sink: TapSink | None = None) -> list[PromptScores]:
        """Prompts batched into engine steps of at most --batch-tokens (as compare runs them); taps to `sink`."""
        return [s for group in self.batch_groups(prompts) for s in self.score(group, taps, sink or (lambda *_: None))]

    def batch_groups(self, prompts: Sequence[Prompt]) -> list[list[Prompt]]:
        """How score_batched groups prompts into engine steps."""
        return list(batches(prompts, self.settings.batch_tokens, self.max_sequences_per_step))

    def sample(self, prompts: Sequence[Prompt], spec: SamplingSpec, taps: frozenset[str], sink: TapSink) -> list[SequenceScores]:
        """Sample `spec.samples_per_prompt` responses per prompt through vLLM's decode path, as an RL rollout does;
        report raw logprobs of every sampled token and vLLM's prompt logprobs, and capture every step's taps."""
        from vllm.inputs import TokensPrompt

        self._check_taps(taps)
        keys, requests, params = [], [], []
        for prompt in prompts:
            for k in range(spec.samples_per_prompt):
                keys.append((prompt, k))
                requests.append(TokensPrompt(prompt_token_ids=list(prompt.token_ids)))
                params.append(self._params(
                    max_tokens=spec.max_new_tokens, temperature=spec.temperature, top_p=spec.top_p,
                    seed=spec.request_seed(prompt.prompt_id, k), logprobs=0, prompt_logprobs=0, detokenize=False))
        with torch.inference_mode(), HookSet() as hooks:
            recorder = RolloutRecorder(self.runner, hooks)

            def after_model(hidden):
                recorder.final_hidden = hidden
                if "final_norm" in taps:
                    recorder.add_tap(TapKey.of("final_norm", len(self.layers)), hidden)

            self._on_model_call(hooks, recorder.begin_step, after_model)
            hooks.after(self.model.logits_processor, lambda m, a, k, o: recorder.add_logits(arg(a, k, 1, "hidden_states"), o))
            self._tap_hooks(hooks, taps, recorder.add_tap)
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        results = []
        internal = recorder.request_ids()
        for seq_id, ((prompt, k), out) in enumerate(zip(keys, outputs)):
            completion = out.outputs[0]
            response = tuple(completion.token_ids)
            tokens = prompt.token_ids + response
            reported = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt.token_ids[1:])]
            reported += [e[t].logprob for e, t in zip(completion.logprobs, response)]
            req_id = internal.get(out.request_id)
            if req_id is None:
                raise StackError(f"vLLM request {out.request_id} left no capture; the runner's ids changed format")
            logits = recorder.stitch(req_id, tokens, seq_id, sink)
            if "logits" in taps:
                sink(seq_id, TapKey.of("logits", len(self.layers)), logits)
            reported_t = torch.tensor(reported, dtype=torch.float32)
            self._check_logits(logits, tokens, reported_t, f"sequence {seq_id}")
            results.append(SequenceScores(seq_id, prompt.prompt_id, k, tokens, len(prompt.token_ids), logits, reported_t))
        return results

    def check_routes_recordable(self) -> None:
        """Refuse now, in one line, an engine whose steps the route recording cannot follow (or one built without
        route tap points): what `routes_recorded` checks on entry, before any rollout needs it."""
        with self.routes_recorded():
            pass

    @contextlib.contextmanager
    def routes_recorded(self, taps: frozenset[str] = frozenset({"expert_ids"})) -> Iterator[RolloutRecorder]:
        """For the block's generate calls, record the experts the engine's router sent every computed row to (the
        select_experts seam, taps.ROUTE_RECORDS' ids: what its experts ran with), filed by request and position; read
        them with `recorder.routes(...)` after the block. No logits; `taps`: what is recorded (the ids, and any other
        per-layer tap to read beside them, e.g. router_logits, through `recorder.routes(..., tap=name)`).
        Eager: a hook on the seam. Compiled: the engine's route tap points (built at load: probe.load's `routes`),
        whose buffers the graph, or a CUDA-graph replay, writes every step and the host reads after the step's
        model call; a padded CUDA-graph batch's extra rows come along and match no request's span (rollout.py)."""
        self._check_taps(taps)  # a compiled engine built without route tap points: one line, not missing rows
        with HookSet() as hooks:
            recorder = RolloutRecorder(self.runner, hooks)
            self._on_model_call(hooks, recorder.begin_step, lambda hidden: None)
            self._tap_hooks(hooks, taps, recorder.add_tap)
            yield recorder

    def _check_logits(self, logits: torch.Tensor, tokens, reported: torch.Tensor, what: str) -> None:
        """The captured logits must reproduce vLLM's own logprobs (Sampler.compute_logprobs), or the KL would describe
        other logits than the ones vLLM scored; the largest gap goes to the manifest.

        On the CPU, vLLM's sampler runs this very float32 log_softmax on these very logits: any gap at all means
        the capture seam moved, so the bound is 0. On a GPU, the sampler's softmax kernel may add a row's
        exponentials in another order than ours (other rows, other launch), which moves
        logit - logsumexp by a few float32 ULPs of its larger term. The bound there is 4 such ULPs per token, twice
        the largest gap measured on an H200 (captured_logits_vs_reported_logprobs_max_gap in the manifests of
        docs/results/h200). A wrong row mapping is off by O(1), far beyond either bound.
        Non-finite logits are left to the NaN/Inf check, which names the stack."""
        gpu_ulps = 4
        targets = torch.tensor(tokens[1:], device=logits.device)
        recomputed = logits.log_softmax(dim=-1, dtype=torch.float32).gather(-1, targets[:, None])[:, 0].cpu()
        gap = (recomputed - reported).abs()
        finite = torch.isfinite(recomputed)
        if finite.any():
            self.recompute_gap = max(self.recompute_gap, gap[finite].max().item())
        if self.settings.device == "cpu":
            allowed = torch.zeros_like(gap)
        else:
            logit = logits.gather(-1, targets[:, None])[:, 0].float().cpu()
            larger = torch.maximum(logit.abs(), (logit - recomputed).abs())  # |logit| or |logsumexp|
            allowed = torch.ldexp(torch.full_like(larger, gpu_ulps), torch.frexp(larger).exponent - 24)
        off = finite & ~(gap <= allowed)
        if off.any():
            i = int(off.nonzero()[0, 0])
            raise StackError(
                f"the logits captured for {what} do not reproduce vLLM's own logprobs (gap {gap[i].item():.3g} at "
                f"position {i + 1}, allowed {allowed[i].item():.3g}); the capture seam moved: report this as a bug"
            )

    def _capture(self, prompts: Sequence[Prompt], taps: frozenset[str], sink: TapSink, step: _Step) -> HookSet:
        hooks = HookSet()
        final_norm = TapKey.of("final_norm", len(self.layers))

        def layout(input_ids):  # input_ids of the step -> spans, matched id for id (the runner may reorder)
            if step.spans:
                raise StackError("vLLM split the batch over several steps; lower --batch-tokens")
            ids = input_ids.tolist()
            unplaced = sorted(prompts, key=lambda p: -len(p.token_ids))  # longest first: a prefix never wins
            row = 0
            while unplaced and row < len(ids):
                match = next((p for p in unplaced if tuple(ids[row : row + len(p.token_ids)]) == p.token_ids), None)
                if match is None:
                    raise StackError(f"vLLM's step holds tokens at row {row} that match no submitted prompt")
                step.spans[match.prompt_id] = (row, len(match.token_ids))
                unplaced.remove(match)
                row += len(match.token_ids)
            if unplaced:
                raise StackError(f"vLLM did not schedule prompt {unplaced[0].prompt_id} in this step")

        def keep_final_hidden(hidden):  # the model's output is its final norm's output
            step.final_hidden = hidden
            if "final_norm" in taps:
                step.split(hidden, sink, final_norm)

        def keep_logits(m, a, k, o):  # prompt-logprob calls slice the final hidden states: locate the rows
            hidden, base = arg(a, k, 1, "hidden_states"), step.final_hidden
            if base is None or hidden.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
                return  # the sampler's call on gathered last rows; not a prompt position
            row = (hidden.data_ptr() - base.data_ptr()) // (base.stride(0) * base.element_size())
            step.add_logits(row, o)

        self._on_model_call(hooks, layout, keep_final_hidden)
        hooks.after(self.model.logits_processor, keep_logits)
        self._tap_hooks(hooks, taps, lambda tap, x: step.split(x, sink, tap))
        return hooks

    def _tap_hooks(self, hooks: HookSet, taps: frozenset[str], on_tap) -> None:
        """Hooks that hand each selected decoder tap of a step, as `[step rows, ...]`, to on_tap(key, tensor), or a
        compiled engine's taps of one width at once (TapPoints.router; `final_norm` and `logits` are captured
        outside the model, in both engine modes)."""
        embedding = find(self.model, layout_of(self.model, "vllm").model["embed"])
        if self.compiled:  # the compiled graph copies into the tap buffers; _on_model_call reads them after each step
            points = self.tap_points
            hooks.replace(points, "active", points.router(on_tap, taps, embedding), owner="compiled taps")
            hooks.replace(points, "wanted", points.wanted_keys(taps), owner="compiled taps")
            return
        if "embed" in taps:
            embed = TapKey.of("embed", -1)
            hooks.after(embedding, lambda m, a, k, o: on_tap(embed, first_tensor(o)))
        for i, seams in enumerate(model_seams(self.model, taps)):
            for seam in seams:
                keys = {name: TapKey.of(name, i) for name in seam.names if name in taps}

                def emit(a, k, o, seam=seam, keys=keys):
                    parts = seam.read(a, k, o)
                    for name, key in keys.items():
                        on_tap(key, parts[name])

                if seam.method is not None:
                    _wrap_method(hooks, seam.module, seam.method, emit)
                elif seam.before:
                    hooks.before(seam.module, lambda m, a, k, emit=emit: emit(a, k, None))
                else:
                    hooks.after(seam.module, lambda m, a, k, o, emit=emit: emit(a, k, o))

    def implementations(self) -> dict[str, str]:
        """Which implementation each region dispatched to, read from the loaded model's first layer."""
        layer, roles = self.layers[0], layout_of(self.model, "vllm").layer
        rope, attention = find(layer, roles["rotary"]), find(layer, roles["attention"])

        def dispatched(module) -> str:
            method = getattr(module, "_forward_method", None)
            return getattr(method, "__qualname__", type(module).__qualname__ + ".forward")

        experts = find(layer, roles["experts"]) if "experts" in roles else None
        impls = {
            "rmsnorm": dispatched(find(layer, roles["input_norm"])),
            "rope": f"{dispatched(rope)} (is_neox_style={getattr(rope, 'is_neox_style', '?')})",
            # a mixture of experts: its runner and the router that picks the experts, not a dense SwiGLU
            **({"experts": f"{type(experts).__qualname__} (router {type(getattr(experts, 'router', None)).__qualname__})"}
               if experts is not None else {"swiglu": dispatched(find(layer, roles["act"]))}),
            "attention": type(getattr(attention, "impl", attention)).__qualname__,
        }
        try:
            from vllm import ir

            impls["rmsnorm"] += f" -> ir rms_norm={ir.ops.rms_norm.get_priority()}"
            impls["rmsnorm"] += f", fused_add_rms_norm={ir.ops.fused_add_rms_norm.get_priority()}"
        except (ImportError, AttributeError):
            pass  # releases before vllm.ir dispatch inside the CustomOp itself
        return impls

    def info(self) -> StackInfo:
        import vllm

        return StackInfo(
            name=self.name,
            versions={"vllm": vllm.__version__, "torch": torch.__version__},
            implementations=self.implementations(),
            settings={
                "engine": self.settings.engine,
                "engine_args": self.settings.engine_kwargs(),  # the user's verbatim, and on CUDA the plan's KV budget
                # built with the dp::tap hooks (another graph than vLLM as deployed) and buffers for these taps
                "engine_tap_points": sorted(_tap_points(self.settings)),
                "tap_buffer_bytes": self.tap_points.buffer_bytes() if self.compiled else 0,
                **self._effective_config(),
                "model_runner": f"{type(self.runner).__module__}.{type(self.runner).__qualname__}",
                "taps": dict(self.capabilities().taps),
                "torch_numerics": torch_state.describe(torch_state.capture()),  # the engine's: the process's now
                "captured_logits_vs_reported_logprobs_max_gap": self.recompute_gap,
            },
        )

    def _effective_config(self) -> dict[str, object]:
        """The engine's settings as vLLM resolved them (read back from the live engine, not from what was asked)."""
        config = self.llm.llm_engine.vllm_config
        comp, sched, cache = config.compilation_config, config.scheduler_config, config.cache_config

        def plain(value):
            return getattr(value, "name", None) or (value if isinstance(value, (bool, int, float, str, type(None))) else str(value))

        effective = {
            "enforce_eager": config.model_config.enforce_eager,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "enable_chunked_prefill": sched.enable_chunked_prefill,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs,
            "kv_cache_dtype": cache.cache_dtype,
            "compilation": {
                "mode": plain(comp.mode),
                "backend": comp.backend,
                "custom_ops": list(comp.custom_ops),
                "enabled_custom_ops": sorted(getattr(comp, "enabled_custom_ops", {}) or {}),
                "disabled_custom_ops": sorted(getattr(comp, "disabled_custom_ops", {}) or {}),
                "cudagraph_mode": plain(comp.cudagraph_mode),
                "cudagraph_capture_sizes": list(comp.cudagraph_capture_sizes or []),
                "splitting_ops": list(comp.splitting_ops or []),
                "inductor_compile_config": {k: plain(v) for k, v in sorted(comp.inductor_compile_config.items())},
                "pass_config": str(comp.pass_config),
            },
        }
        kernel = getattr(config, "kernel_config", None)
        if kernel is not None and hasattr(kernel, "ir_op_priority"):
            effective["compilation"]["ir_op_priority"] = str(kernel.ir_op_priority)
        return effective

    # The RolloutEngine protocol (engines/rollout_protocol.py): an RL loop samples, pushes weights and proves each push
    # through these, never through vllm.LLM.

    @property
    def prefix_caching(self) -> bool:
        return bool(self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)

    def start_weight_sync(self, tied_head: bool, vocab_size: int) -> None:
        self.weight_session = WeightSession(self.llm, self.model, tied_head, vocab_size)

    def rollout(self, samples: Sequence[RolloutSample], *, routes: bool = False) -> list[Rolled]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(s.prompt)) for s in samples]
        params = [SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=1.0, seed=s.seed, logprobs=0,
                                 detokenize=False) for s in samples]
        cache_probe = self.weight_session.cache_probe if self.weight_session is not None else None
        carry_probe = cache_probe is not None and cache_probe.due  # the push before: proven fresh by this call
        if carry_probe:
            request, param = cache_probe.request()
            requests.append(request)
            params.append(param)
        with contextlib.ExitStack() as scope:
            recorder = scope.enter_context(self.routes_recorded()) if routes else None
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        if carry_probe:
            cache_probe.verdict(outputs.pop())  # outputs come in request order: the probe's is the last
        rolled = []
        for out in outputs:
            c = out.outputs[0]
            rolled.append(Rolled(tuple(c.token_ids), [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]))
        if recorder is not None:  # the engine's experts of every fed row, prompt and response: [len-1, layers, k]
            by_id = recorder.routes({out.request_id: tuple(out.prompt_token_ids) + r.tokens
                                     for out, r in zip(outputs, rolled)}, len(self.layers))
            for out, r in zip(outputs, rolled):
                r.routes = by_id[out.request_id]
        return rolled

    def push_weights(self, weights) -> float:
        return self.weight_session.push(weights)

    @property
    def push_unproven(self) -> bool:
        return self.weight_session.cache_probe.due

    @property
    def probe_moved(self) -> bool | None:
        return self.weight_session.cache_probe.moved

    def prove_push(self, weights, audit: bool = False) -> SyncCheck:
        return self.weight_session.prove(weights, audit)

    def prove_cache(self) -> None:
        self.weight_session.prove_cache()

    def close(self) -> None:
        """The engine stays alive for reuse in this process (see module docstring); drop our references."""
        self.llm = self.runner = self.model = self.weight_session = None


def _wrap_method(hooks: HookSet, obj, name: str, emit) -> None:
    """obj.name replaced, until the HookSet exits, by a call that hands (args, kwargs, result) to emit: a seam on an
    object that is not an nn.Module (a MoE router), which has no forward hooks."""
    hooks.replace(obj, name, after_call(getattr(obj, name), emit), owner="the route records of a vLLM capture")
