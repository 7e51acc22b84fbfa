"""ScoreSpec: what score reads and how it scores it; its trainer's options are a LoadSpec beside it."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ProbeError
from ..options import option
from ..rollouts.adapters import FORMATS, parse_fields
from .fields import check_finite
from .generate import GenerateSpec
from .load import DEFAULT_INFER


@dataclass(frozen=True, kw_only=True)
class ScoreSpec:
    """What score reads and how it scores it, beside the LoadSpec of its trainer: the manifest records both
    (score.spec, score.load_spec) and `rerun` reads them back with the checks their flags get (spec.recorded)."""

    rollouts: str = option(help="The rollout file, as an absolute path (a rerun may start elsewhere).",
                           flag="ROLLOUTS", cli=False)  # score's argument: files, a folder or a glob
    fmt: str = option("auto", "auto (from the field names), verl, openrlhf, slime, trl or generic.", flag="--format")
    fields: str | None = option(None, "Generic format's columns: prompt_ids=COL,response_ids=COL,logprobs=COL[,group="
                                      "COL]; in any format, the two logprob columns: infer=COL,train=COL (with the "
                                      "trainer's, no model is needed).")
    infer: str | None = option(None, "vllm: also re-score every sequence with the engine's prefill (logprob_prefill; "
                                     "the three-way split).")
    temperature: float | None = option(None, "The run's sampling temperature: every logprob compared (trainer, "
                                             "prefill, KL) is taken at it, as in a tempered recording; the raw gap "
                                             "stays beside it.")
    clip_eps: float = option(GenerateSpec.clip_eps, "PPO clip band [1-eps, 1+eps] for the ratio metrics.")
    tis_cap: float = option(GenerateSpec.tis_cap, "TIS truncation cap C (token MIS band [1/C, C]).")

    def __post_init__(self) -> None:
        check_finite(self)
        if self.infer not in (None, DEFAULT_INFER):  # the engine a rollout came from
            raise ProbeError(f"--infer {self.infer!r}: score re-scores with vllm or not at all; use --infer vllm or "
                             "leave it out")
        if self.fmt not in FORMATS:
            raise ProbeError(f"--format {self.fmt!r} is unknown; use one of {', '.join(FORMATS)}")
        parse_fields(self.fields)
        if self.temperature is not None and not self.temperature > 0:
            raise ProbeError(f"--temperature {self.temperature} must be > 0: it is the sampling temperature to test "
                             "against")
        GenerateSpec(clip_eps=self.clip_eps, tis_cap=self.tis_cap)  # their checks


# score's options, in the order --help lists them: (the spec that declares the field, its name, the help score gives
# it when the field's own speaks of compare's two stacks rather than score's one trainer; None: the field's own).
SCORE_FLAGS = (
    ("load", "model", "The checkpoint the rollouts were sampled from (folder or hub id). Default: the built-in tiny "
                      "trained Qwen3."),
    ("score", "fmt", None),
    ("score", "fields", None),
    ("score", "infer", None),
    ("score", "temperature", None),
    ("load", "dtype", "The trainer's dtype: bfloat16, float16 or float32."),
    ("load", "device", None),
    ("load", "train_attn", "transformers attention: sdpa, eager or flash_attention_2."),
    ("load", "train_sdpa", "SDPA kernel: auto, math, flash, efficient or cudnn."),
    ("load", "train_kernels", "The trainer's kernel set: torch (transformers' ops), vllm (the engine's RMSNorm, "
                              "add+norm, SiLU-and-mul and rotary kernels) or liger (Liger-Kernel's; CUDA only)."),
    ("score", "clip_eps", None),
    ("score", "tis_cap", None),
    ("load", "allow_untested_versions", None),
)
