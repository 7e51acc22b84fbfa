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
from dataclasses import dataclass, field

import torch

from .environment import environment, resolve_device
from .errors import ProbeError
from .compare import CompareOptions, run_compare
from .model_source import ModelSource, resolve_model
from .stacks import INFER_STACKS, TRAIN_STACK, Stack, StackSettings, get_stack
from .stacks.base import freeze_engine_args

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TRAIN_ATTN = ("sdpa", "eager", "flash_attention_2")


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """What is loaded, and how. Both stacks get the same model files, dtype, device and seed."""

    model: str | None = None
    """Local checkpoint folder or hub id; None = the built-in default model."""
    infer: str = "vllm"
    """Inference side: vllm, or hf for a second, independent transformers instance (a zero baseline)."""
    dtype: str = "bfloat16"
    device: str = "auto"
    """auto (cuda when present), cpu or cuda."""
    train_attn: str = "sdpa"
    """transformers attention implementation on the training side."""
    seed: int = 0
    batch_tokens: int = 8192
    """Most prompt tokens per inference batch; bounds the memory held for tap pairing."""
    engine: str = "eager"  # minimal pass-through to StackSettings until the run spec owns these three
    engine_args: dict | None = None
    train_sdpa: str = "auto"

    def __post_init__(self) -> None:
        if self.infer not in INFER_STACKS:
            raise ProbeError(f"--infer {self.infer!r} is not a stack; choose one of: {', '.join(INFER_STACKS)}")
        if self.dtype not in DTYPES:
            raise ProbeError(f"--dtype {self.dtype!r} is not supported; choose one of: {', '.join(DTYPES)}")
        if self.train_attn not in TRAIN_ATTN:
            raise ProbeError(f"--train-attn {self.train_attn!r}; choose one of: {', '.join(TRAIN_ATTN)}")
        if self.batch_tokens < 1:
            raise ProbeError("--batch-tokens must be positive")


@dataclass
class Probe:
    config: LoadConfig
    source: ModelSource
    settings: StackSettings
    infer: Stack
    train: Stack
    tokenizer: object
    _environment: dict = field(default_factory=dict)

    def compare(self, *, align: str | tuple[str, ...] = (), side: str = "both", generate: dict | None = None,
                **options):
        """Diff the two stacks on prompts (options: `divergence_probe.compare.CompareOptions`), optionally
        with `align` regions aligned on `side` ("both", "train" or "infer"). `generate` (a dict of
        `divergence_probe.rollout.GenerateOptions`) switches to generate mode: sampled responses, decode path."""
        from .ablate import run_aligned_compare

        return run_aligned_compare(self, self._runner(generate), CompareOptions(**options), align, side)

    def _runner(self, generate: dict | None):
        """The single-run function for prefill (compare) or generate mode."""
        if generate is None:
            return run_compare
        from .rollout import GenerateOptions, run_generate

        gen = GenerateOptions(**generate)
        return lambda probe, options: run_generate(probe, options, gen)

    def ablate(self, *, regions=("rope", "swiglu", "rmsnorm"), side: str = "both", metric: str = "mean_kl",
               bootstrap: int = 1000, generate: dict | None = None, **options):
        """Every subset of `regions` aligned, one compare (or generate-mode run) each, and the attribution."""
        from .ablate import AblateOptions, run_ablation

        ablate = AblateOptions(regions=regions, side=side, metric=metric, bootstrap=bootstrap, seed=self.config.seed)
        return run_ablation(self, self._runner(generate), CompareOptions(**options), ablate)

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
                "train": TRAIN_STACK,
                "dtype": self.config.dtype,
                "device": self.settings.device,
                "train_attn": self.config.train_attn,
                "seed": self.config.seed,
                "batch_tokens": self.config.batch_tokens,
                "max_model_len": self.settings.max_model_len,
            },
            "stacks": {side: vars(stack.info()) for side, stack in (("infer", self.infer), ("train", self.train))},
            "environment": self._environment,
        }

    def close(self) -> None:
        self.infer.close()
        self.train.close()

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(model: str | None = None, **config) -> Probe:
    """Resolve the model, load it into the training stack (checking weights) and the inference stack."""
    from transformers import AutoTokenizer

    cfg = LoadConfig(model=model, **config)
    source = resolve_model(cfg.model)
    settings = StackSettings(
        model_path=str(source.path),
        dtype=DTYPES[cfg.dtype],
        device=resolve_device(cfg.device),
        seed=cfg.seed,
        max_model_len=source.max_model_len,
        train_attn=cfg.train_attn,
        batch_tokens=cfg.batch_tokens,
        engine=cfg.engine,
        engine_args=freeze_engine_args(cfg.engine_args or {}),
        train_sdpa=cfg.train_sdpa,
    )
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    train = get_stack(TRAIN_STACK)
    train.load(settings)  # first: it checks the weights for NaN/Inf before the slower engine starts
    infer = get_stack(cfg.infer)
    infer.load(settings)
    return Probe(cfg, source, settings, infer, train, tokenizer, environment(settings.device))
