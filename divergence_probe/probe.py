"""A Probe holds one model loaded in two stacks (inference and training) and runs experiments on it.

    import divergence_probe as dp
    probe = dp.load("Qwen/Qwen2.5-1.5B", infer="vllm", dtype="bfloat16")
    run = probe.compare(prompts="sample_prompts", taps="all")
    print(run.summary)
    run.write("runs/qwen")

Loading is the expensive part (engine start-up), so a Probe is made once and reused for every
comparison and ablation on that model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import torch

from .compare import Progress, run_compare
from .environment import environment, resolve_device
from .errors import ProbeError
from .model_source import ModelSource, resolve_model
from .spec import LoadSpec, RunSpec, flat_fields, spec_from_flat
from .stacks import Stack, StackSettings, get_stack
from .stacks.base import freeze_engine_args
from .stacks.compiled_taps import tap_points_for

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LoadConfig = LoadSpec  # the name of earlier releases


@dataclass
class Probe:
    config: LoadSpec
    source: ModelSource
    settings: StackSettings
    infer: Stack
    train: Stack
    tokenizer: object
    _environment: dict = field(default_factory=dict)
    owns_infer: bool = True  # False for a with_trainer() view: closing it leaves the shared engine to its owner

    def run(self, spec: RunSpec, progress: Progress | None = None):
        """Run a spec on the loaded stacks; its load settings must be the ones this probe was loaded with."""
        if spec.load != self.config:
            raise ProbeError("the run spec asks for other load settings than this probe was loaded with; "
                             "load a probe for them (divergence_probe.run(spec) does both)")
        if hasattr(self.infer, "recompute_gap"):  # the manifest's captured-logits gap describes this run alone
            self.infer.recompute_gap = 0.0
        if spec.kind == "ablate":
            from .ablate import run_ablation

            return run_ablation(self, spec, progress)
        from .engine_align import aligned_probe

        with aligned_probe(self, spec.align.regions, spec.align.side) as probe:
            return run_compare(probe, spec, progress)

    def compare(self, *, progress: Progress | None = None, generate: dict | None = None, **options):
        """Diff the two stacks on prompts. `options` are compare's flags by their Python names (prompts, taps,
        align, side, mode, max_new_tokens, ...: `divergence_probe.spec.flat_fields("compare")`); `generate`, a
        dict of generate-mode options, is shorthand for mode="generate" plus those options."""
        return self.run(self._spec("compare", generate, options), progress)

    def ablate(self, *, progress: Progress | None = None, generate: dict | None = None, **options):
        """Every subset of `regions` aligned, one compare (or generate-mode run) each, and the attribution."""
        return self.run(self._spec("ablate", generate, options), progress)

    def _spec(self, kind: str, generate: dict | None, options: dict) -> RunSpec:
        if generate is not None:
            options = options | {"mode": "generate"} | generate
        load_options = sorted(set(options) & {name for component, _, name in flat_fields(kind) if component == "load"})
        if load_options:
            raise ProbeError(f"{', '.join(load_options)}: load settings are fixed when a probe is loaded; pass them to "
                             "divergence_probe.load(...) (or use probe.with_trainer(...) for the training side)")
        return spec_from_flat(kind, load=self.config, **options)

    def with_trainer(self, **changes) -> "Probe":
        """This probe's engine beside another training side (e.g. train_sdpa="math", train_state="inherited"):
        the engine is not reloaded, so two training configurations are compared against the very same engine."""
        allowed = {"train", "train_attn", "train_sdpa", "train_state"}
        if set(changes) - allowed:
            raise ProbeError(f"with_trainer changes only {', '.join(sorted(allowed))}; load a new probe for the rest")
        config = replace(self.config, **changes)
        settings = stack_settings(config, self.source, engine_taps=self.settings.engine_taps)
        train = get_stack(config.train)
        train.load(settings)
        return replace(self, config=config, settings=settings, train=train, owns_infer=False)

    def manifest(self) -> dict:
        """Everything about the loaded setup that a reader needs to reproduce a run."""
        return {
            "model": {
                "spec": self.source.spec,
                "path": str(self.source.path),
                "arch": self.source.arch,
                "num_layers": self.source.num_layers,
                "config_sha256": self.source.config_sha256,
            },
            "load": {
                "infer": self.config.infer,
                "train": self.config.train,
                "dtype": self.config.dtype,
                "device": self.settings.device,
                "train_attn": self.config.train_attn,
                "train_sdpa": self.config.train_sdpa,
                "train_state": self.config.train_state,
                "engine": self.config.engine,
                "engine_args": self.config.engine_args,
                "seed": self.config.seed,
                "batch_tokens": self.config.batch_tokens,
                "max_model_len": self.settings.max_model_len,
            },
            "stacks": {side: vars(stack.info()) for side, stack in (("infer", self.infer), ("train", self.train))},
            "environment": self._environment,
        }

    def close(self) -> None:
        if self.owns_infer:
            self.infer.close()
        self.train.close()

    def __enter__(self) -> "Probe":
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
        engine_taps=engine_taps,
    )


def load(model: str | None = None, *, spec: LoadSpec | None = None, before_stacks=None, taps: str | None = None,
         **config) -> Probe:
    """Resolve the model, load it into the training stack (checking weights) and the inference stack.
    `config`: the fields of `divergence_probe.spec.LoadSpec` (infer, dtype, device, engine, ...).
    `taps` (e.g. "all"): the layer taps later runs will ask for. Only a compiled engine cares: it is then built with
    tap points, which is another compiled graph than vLLM as deployed, and device buffers for exactly these taps
    (stacks/compiled_taps.py): later runs can capture those, not others.
    `before_stacks(source, tokenizer)` runs once the checkpoint and tokenizer are known and before the slow loads:
    the CLI checks the prompts there, so a bad prompt fails in seconds, not after an engine start."""
    from transformers import AutoTokenizer

    if spec is not None and (model is not None or config):
        raise ProbeError("load() takes a LoadSpec or loose settings, not both; put every setting in the spec")
    cfg = spec or LoadSpec(model=model, **config)
    source = resolve_model(cfg.model)
    settings = stack_settings(cfg, source)
    settings = replace(settings, engine_taps=tap_points_for(taps, settings))
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    if before_stacks is not None:
        before_stacks(source, tokenizer)
    train = get_stack(cfg.train)
    train.load(settings)  # first: it checks the weights for NaN/Inf before the slower engine starts
    infer = get_stack(cfg.infer)
    try:
        infer.load(settings)
    except BaseException:
        train.close()
        raise
    return Probe(cfg, source, settings, infer, train, tokenizer, environment(settings.device))


def run(spec: RunSpec, progress: Progress | None = None):
    """Load the spec's model into both stacks, run it, and return the run (CompareRun or AblationRun)."""
    probe = load(spec=spec.load, taps=spec.capture.taps)
    return probe.run(spec, progress)
