"""Loading one model into both stacks: the settings both get, the memory plan that sizes the load for a run, and the
loads themselves, the trainer first (it checks the weights before the engine starts). Apart from the runs a probe
makes (runs/probe.py), so a reader that only needs the loaded stacks (score's prefill) does not import the run loop.
"""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from . import memory as memory_plan
from ..engines import torch_state
from .. import timings, versions
from .manifest import model_section
from .out_of_memory import is_out_of_memory
from .reference_plan import check_planned
from .side_settings import TORCH_DTYPES, engine_settings, train_settings
from ..environment import resolve_device, resolve_train_device, same_device
from ..errors import DeviceMemoryError, ProbeError
from ..models.size import ModelSize, device_memory
from ..models.source import ModelSource, resolve_model
from ..prompts import Prompt, load_prompts
from ..quiet import libraries_quieted
from ..spec.load import LoadSpec
from ..spec.run import RunSpec, check_family, stacks_beside
from ..engines import stack_class
from ..engines.protocol import Stack, StackSettings, freeze_engine_args


@dataclass
class LoadedStacks:
    """One model loaded in two stacks (inference and training), and what a run's manifest says of the load."""

    config: LoadSpec
    source: ModelSource
    settings: StackSettings
    infer: Stack
    train: Stack
    tokenizer: object
    _environment: dict = field(default_factory=dict)
    owns_infer: bool = True  # False for a with_trainer() view: closing it leaves the shared engine to its owner
    memory_plan: memory_plan.MemoryPlan | None = None  # what load() planned to hold on the device (runs/memory.py)
    load_peak_bytes: int | None = None  # CUDA: the allocator's peak while both stacks loaded (the engine's start-up)
    quiet: bool = True  # the libraries' own output quieted while a run runs (quiet.py)
    placement: dict | None = None  # how the stacks shared the device, and why (Prepared.placement)
    checked: RunSpec | None = None  # the run the load checked (check_family) before anything loaded
    prompts: dict = field(default_factory=dict)  # a run's prompts, tokenized once (run_prompts)

    def with_trainer(self, **changes) -> "LoadedStacks":
        """This probe's engine beside another training side (e.g. train_sdpa="math", train_state="inherited"):
        the engine is not reloaded, so two training configurations are compared against the very same engine."""
        allowed = {"train", "train_attn", "train_sdpa", "train_state", "train_tp", "train_precision", "train_kernels",
                   "dtype"}  # dtype: the trainer of an engine loaded beside in that dtype too (remedies' fp16 arm)
        if set(changes) - allowed:
            raise ProbeError(f"with_trainer changes only {', '.join(sorted(allowed))}; load a new probe for the rest")
        config = replace(self.config, **changes)
        settings = replace(stack_settings(config, self.source, engine_taps=self.settings.engine_taps),
                           batch_tokens=self.settings.batch_tokens, engine_args=self.settings.engine_args)  # as planned
        train = stack_for(config.train, settings)
        train.load(train_settings(config, settings))
        return replace(self, config=config, settings=settings, train=train, owns_infer=False)

    def run_prompts(self, spec: RunSpec) -> tuple[Path, list[Prompt]]:
        """The run's prompts, tokenized and checked against the context once: the load read them for its plan, and
        every combination of an ablation, every pass of an alternate placement reads the same."""
        key = _prompts_key(spec)
        if key not in self.prompts:
            self.prompts[key] = load_run_prompts(spec, self.tokenizer, self.settings.max_model_len)
        return self.prompts[key]

    def manifest(self) -> dict:
        """Everything about the loaded setup that a reader needs to reproduce a run."""
        return {
            "model": model_section(self.source),
            "load": {
                "infer": self.config.infer,
                "train": self.config.train,
                "dtype": self.config.dtype,
                "device": self.settings.device,
                "train_device": resolve_train_device(self.config.train_device, self.config.device),
                "train_attn": self.config.train_attn,
                "train_sdpa": self.config.train_sdpa,
                "train_state": self.config.train_state,
                "train_precision": self.config.train_precision,
                "train_kernels": self.config.train_kernels,
                "train_tp": self.config.train_tp,
                "engine": self.config.engine,
                "engine_args": self.config.engine_args,
                "seed": self.config.seed,
                "batch_tokens": self.config.batch_tokens,
                "placement": self.config.placement,
                "max_model_len": self.settings.max_model_len,
            },
            "stacks": {side: vars(stack.info()) for side, stack in (("infer", self.infer), ("train", self.train))},
            "environment": self._environment,
            **({"memory_plan": self.memory_plan.record() | {"measured_load_peak_bytes": self.load_peak_bytes}}
               if self.memory_plan is not None else {}),
            **({"placement": dict(self.placement)} if self.placement is not None else {}),
        }

    def close(self) -> None:
        if self.owns_infer:
            self.infer.close()
        self.train.close()

    def __enter__(self) -> "LoadedStacks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stack_settings(cfg: LoadSpec, source: ModelSource, engine_taps: frozenset[str] = frozenset()) -> StackSettings:
    """What both stacks are loaded with: one object, so the two sides provably get the same dtype and device."""
    return StackSettings(
        model_path=str(source.path),
        dtype=TORCH_DTYPES[cfg.dtype],
        device=resolve_device(cfg.device),
        seed=cfg.seed,
        max_model_len=source.max_model_len,
        train_attn=cfg.train_attn,
        batch_tokens=cfg.batch_tokens,
        engine=cfg.engine,
        engine_args=freeze_engine_args(cfg.engine_args),
        train_sdpa=cfg.train_sdpa,
        train_state=cfg.train_state,
        train_precision=cfg.train_precision,
        train_kernels=cfg.train_kernels,
        train_tp=cfg.train_tp,
        engine_taps=engine_taps,
    )


def stack_for(name: str, settings: StackSettings) -> Stack:
    """A fresh, unloaded stack of the registry's `name`, the variant these settings need (StackClass.for_settings:
    a trainer sharded at train_tp > 1, an engine over its tensor-parallel ranks)."""
    return stack_class(name).for_settings(settings)


def load_stacks(model: str | None = None, *, spec: LoadSpec | None = None, before_stacks=None,
                taps: str | None = None, plan_for: RunSpec | None = None, routes: bool = False, quiet: bool = True,
                loaded: type[LoadedStacks] = LoadedStacks, **config) -> LoadedStacks:
    """divergence_probe.load (runs/probe.py load, whose docstring says each argument), building `loaded`: a Probe,
    or LoadedStacks alone for a reader that runs nothing on them (score's prefill)."""
    if spec is not None and (model is not None or config):
        raise ProbeError("load() takes a LoadSpec or loose settings, not both; put every setting in the spec")
    with libraries_quieted(quiet):
        probe = _load(spec or LoadSpec(model=model, **config), before_stacks, taps, plan_for, routes, loaded)
    probe.quiet = quiet
    return probe


@dataclass
class Prepared:
    """What a load decides before either stack loads: the model, the settings both stacks get, the memory plan and
    the placement it chose (`placement`: "together" or "alternate", and why), and for alternate where the engine's
    outputs will be kept (`kept`: memory_plan.keep_where's record)."""

    config: LoadSpec
    source: ModelSource
    settings: StackSettings
    tokenizer: object
    plan: memory_plan.MemoryPlan
    placement: dict
    kept: dict | None = None
    checked: RunSpec | None = None  # the run it was prepared for, checked (check_family) before anything loads
    prompts: dict = field(default_factory=dict)  # that run's prompts, tokenized once (LoadedStacks.run_prompts)

    @property
    def alternate(self) -> bool:
        return self.placement["placement"] == "alternate"


def _load(cfg: LoadSpec, before_stacks, taps: str | None, plan_for: RunSpec | None, routes: bool,
          loaded: type[LoadedStacks]) -> LoadedStacks:
    """load()'s work, under its quieting: a loaded probe holds both stacks at once."""
    if cfg.placement == "alternate":
        raise ProbeError("a loaded probe holds both stacks at once (load(), rl), which --placement alternate never "
                         "does; run the spec with divergence_probe.run(spec) (or compare/ablate), or use --placement "
                         "together")
    return load_prepared(prepare(cfg, before_stacks, taps, plan_for, routes, can_alternate=False), loaded)


def prepare(cfg: LoadSpec, before_stacks, taps: str | None, plan_for: RunSpec | None, routes: bool = False, *,
            can_alternate: bool, spill_near: Path | None = None, check=None, gate=None) -> Prepared:
    """Everything before the loads, in order: the versions and inputs checked, the model resolved, its family checked
    against the run, the tokenizer loaded and `before_stacks(source, tokenizer)`, `check(source)` and the gate's
    model condition (`gate.check_model(family)`) asked, the run's prompts read and tokenized once, the memory plan
    made and the placement chosen (`can_alternate`: the caller can run the spec one stack at a time). Under
    alternate, where the engine's outputs will be kept is decided here too (chunk files beside `spill_near`, or in the
    temp folder, when the host cannot hold them), so a run that fits neither way is refused before anything loads."""
    with timings.timed("load.import_transformers"):
        from transformers import AutoTokenizer

    infer = stack_class(cfg.infer)
    versions.check(infer.libraries, cfg.allow_untested_versions)  # before anything loads or imports vLLM
    # the training side's SDPA choice, checked again at its first forward, is known now: refuse it in seconds, not
    # after both stacks have loaded
    torch_state.check_sdpa(cfg.train_sdpa, resolve_train_device(cfg.train_device, cfg.device), cfg.train_attn)
    source = resolve_model(cfg.model)
    check_family(plan_for, cfg, source.family)  # what the model's family cannot do yet: one line, before the loads
    settings = stack_settings(cfg, source)
    stack_class(cfg.train).check_model(train_settings(cfg, settings), source.config)
    infer.check_model(engine_settings(settings), source.config)  # what each side cannot run of this model, unloaded
    settings = replace(settings, engine_taps=infer.plan(settings, family=source.family, taps=taps,
                                                         routes=routes or _replays_routes(plan_for)).taps)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    with timings.timed("load.tokenizer_prompts_plan"):
        tokenizer = AutoTokenizer.from_pretrained(source.path)
        if before_stacks is not None:
            before_stacks(source, tokenizer)
        if check is not None:
            check(source)
        if gate is not None:
            gate.check_model(source.family)
        prompts = None if plan_for is None else load_run_prompts(plan_for, tokenizer, source.max_model_len)
        plan, why, settings = _planned(cfg, source, settings, plan_for, prompts,
                                       can_alternate and _can_alternate(cfg, plan_for))
    placement = {"placement": "alternate" if plan.inputs.alternate else "together", "why": why}
    kept = None
    if plan.inputs.alternate:
        import tempfile

        import secrets

        parent = spill_near.absolute().parent if spill_near is not None else Path(tempfile.gettempdir())
        name = f".{spill_near.name}." if spill_near is not None else "divergence-probe-"
        kept = memory_plan.keep_where(plan, str(parent))
        kept["folder"] = str(parent / f"{name}engine-outputs-{secrets.token_hex(4)}")
    return Prepared(cfg, source, settings, tokenizer, plan, placement, kept, plan_for,
                    {} if prompts is None else {_prompts_key(plan_for): prompts})


def _can_alternate(cfg: LoadSpec, run: RunSpec | None) -> bool:
    """Whether this run can hold one stack at a time: a compare or ablate without --graft/--depth (which run the
    trainer on the engine's tensors as they are made) and without a --reference that replays the engine's ops, the
    trainer on the engine's device, unsharded."""
    return run is not None and not (run.capture.graft or run.capture.depth or run.reference_replays_infer()) \
        and cfg.train_device is None and cfg.train_tp == 1


def load_prepared(prepared: Prepared, loaded: type[LoadedStacks]) -> LoadedStacks:
    """Both stacks loaded as prepared, the trainer first (it checks the weights before the engine starts)."""
    cfg, source, settings, tokenizer, plan = (prepared.config, prepared.source, prepared.settings, prepared.tokenizer,
                                              prepared.plan)
    train = stack_for(cfg.train, settings)
    with memory_errors(plan, "loading the training stack"), timings.timed("load.train"):
        train.load(train_settings(cfg, settings))  # first: it checks the weights for NaN/Inf before the engine starts
    infer = stack_for(cfg.infer, engine_settings(settings))  # over its ranks where its args ask for several
    try:
        with memory_errors(plan, "starting the inference stack"), timings.timed("load.infer"):
            infer.load(engine_settings(settings))
    except BaseException:
        train.close()
        raise
    load_peak = int(torch.cuda.max_memory_allocated()) if settings.device == "cuda" else None
    return loaded(cfg, source, settings, infer, train, tokenizer, versions.environment(settings.device),
                  memory_plan=plan, load_peak_bytes=load_peak, placement=prepared.placement, checked=prepared.checked,
                  prompts=prepared.prompts)


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _replays_routes(run: RunSpec | None) -> bool:
    """Whether the run replays the engine's routes into the trainer (routing among its regions): a compiled engine
    then needs tap points for its route records even without router_logits among the taps."""
    return run is not None and "routing" in (run.ablate.regions if run.kind == "ablate" else run.align.regions)


def _planned(cfg: LoadSpec, source: ModelSource, settings: StackSettings, plan_for: RunSpec | None,
             prompts: tuple[Path, list[Prompt]] | None, can_alternate: bool) -> tuple[memory_plan.MemoryPlan, str, StackSettings]:
    """The memory plan for this load (raises DeviceMemoryError when nothing fits), why its placement, and the settings
    it implies: the planned batch_tokens, and the engine args its class plans for the KV budget (StackClass.plan; the
    user's own engine args win)."""
    from ..models.checkpoint import checkpoint_tensors

    free, total, source_of_free = device_memory(settings.device)
    train_device = resolve_train_device(cfg.train_device, cfg.device)
    apart = not same_device(train_device, settings.device)  # the trainer on a device of its own: planned apart
    train_free, train_total, train_source = device_memory(train_device) if apart else (0, 0, "")
    size = ModelSize.of(source.config, source.family, checkpoint_tensors(source.path))
    if plan_for is not None:
        lengths = tuple(len(p.token_ids) for p in prompts[1])
        tap_names, g = plan_for.capture.tap_names, plan_for.generate
        new, samples = (g.max_new_tokens, g.samples_per_prompt) if g.generates else (0, 1)
    else:  # the worst case: every tap, and batches of one prompt of batch_tokens tokens
        lengths, new, samples = (), 0, 1
        tap_names = frozenset(size.tap_widths()) | {"logits"}
    infer = stack_class(cfg.infer)
    engine = infer.plan(settings, size=size, total_bytes=total, stacks_on_device=1 if apart else 2)
    default_batch = next(f.default for f in fields(LoadSpec) if f.name == "batch_tokens")
    inputs = memory_plan.PlanInputs(
        model=size,
        dtype_bytes=_DTYPE_BYTES[cfg.dtype], taps=frozenset(tap_names), prompt_lengths=lengths,
        batch_tokens=cfg.batch_tokens, batch_tokens_fixed=cfg.batch_tokens != default_batch,
        max_model_len=settings.max_model_len, device=settings.device, free_bytes=free, free_source=source_of_free,
        engine_kv=engine.kv_bytes_per_token is not None, engine=cfg.engine, new_tokens=new, samples=samples,
        kv_cache_bytes_fixed=engine.kv_cache_bytes, engine_share=engine.share,
        kv_bytes_per_token=engine.kv_bytes_per_token,
        reduction="eager" if os.environ.get("DIVERGENCE_PROBE_EAGER") == "1" else "compiled",
        noise_floor=plan_for is not None and plan_for.capture.batch_invariance,
        tensor_parallel=engine.ranks,
        train_amp=cfg.train_precision == "amp", train_device=train_device if apart else None, train_tp=cfg.train_tp,
        train_free_bytes=train_free, train_free_source=train_source,
        engine_passes=_engine_passes(plan_for), engine_noise=plan_for is not None and plan_for.capture.engine_noise,
        beside=stacks_beside(plan_for), cost_step=plan_for is not None and plan_for.kind == "remedies",
        reference=plan_for.capture.reference if plan_for is not None else None)
    plan, why = memory_plan.placed(inputs, cfg.placement, can_alternate)
    plan = check_planned(plan, cfg.placement, can_alternate)  # the reference's line where only it does not fit
    memory_plan.enforce_cap(plan, total)
    memory_plan.enforce_train_cap(plan, train_total)
    planned = infer.plan(settings, size=size, total_bytes=total, stacks_on_device=1 if apart else 2,
                         budget=(plan.kv_cache_bytes, plan.engine_share(total)) if total else None).engine_args
    return plan, why, replace(settings, batch_tokens=plan.batch_tokens,
                              engine_args=freeze_engine_args({**planned, **cfg.engine_args}))


def _engine_passes(run: RunSpec | None) -> int:
    """How many times the engine runs every prompt: once, or once per engine-side configuration of an ablation."""
    if run is None or run.kind != "ablate":
        return 1
    from ..numerics.shapley import subsets

    return len({run.combination(c).engine_configuration for c in subsets(run.ablate.players)})


@contextmanager
def memory_errors(plan: memory_plan.MemoryPlan | None, phase: str):
    """An out-of-memory in the block (torch's, a CPU allocation, vLLM's start-up checks) as one DeviceMemoryError."""
    try:
        yield
    except DeviceMemoryError:
        raise
    except Exception as e:
        if is_out_of_memory(e):
            raise memory_plan.out_of_memory_error(e, plan, phase) from e
        raise


def _prompts_key(spec: RunSpec) -> tuple:
    """What the run's tokenized prompts depend on (load_run_prompts reads these)."""
    return spec.prompts, spec.generate.generates, spec.generate.max_new_tokens


def load_run_prompts(spec: RunSpec, tokenizer, max_model_len: int) -> tuple[Path, list[Prompt]]:
    """The run's prompts, tokenized, checked against the context (generate mode keeps room for the response)."""
    path = spec.prompts.path
    context = max_model_len
    if spec.generate.generates:
        if spec.generate.max_new_tokens >= context - 1:
            raise ProbeError(f"--max-new-tokens {spec.generate.max_new_tokens} leaves no room for a prompt in the "
                             f"context of {context} tokens")
        context -= spec.generate.max_new_tokens
    prompts = load_prompts(path, tokenizer, num_prompts=spec.prompts.num_prompts,
                           max_prompt_tokens=spec.prompts.max_prompt_tokens, max_model_len=context)
    return path, prompts
