"""ScoreSpec: what score reads and how it scores it; its trainer's options are a LoadSpec beside it."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ProbeError
from ..options import check_finite, option
from ..rollouts.adapters import FORMATS, parse_fields
from .generate import GenerateSpec
from .load import DEFAULT_INFER


@dataclass(frozen=True, kw_only=True)
class ScoreSpec:
    """What score reads and how it scores it, beside the LoadSpec of its trainer: the manifest records both
    (score.spec, score.load_spec) and `rerun` reads them back with the checks their flags get (spec.recorded)."""

    rollouts: str = option(help="The rollout file, as an absolute path (a rerun may start elsewhere).",
                           flag="ROLLOUTS")
    fmt: str = option("auto", flag="--format")
    fields: str | None = option(None)
    infer: str | None = option(None)
    temperature: float | None = option(None)
    clip_eps: float = option(GenerateSpec.clip_eps)
    tis_cap: float = option(GenerateSpec.tis_cap)

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
