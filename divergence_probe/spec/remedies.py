"""RemediesSpec: which candidate remedies a `remedies` run tries against the stacks as shipped, and how it measures
each one's effect and cost (runs/remedies.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ProbeError
from ..numerics.shapley import METRICS
from ..options import option
from .fields import check_finite

# The candidate arms, by name: what each changes is runs/remedies.py's ARMS (the published claim it tests, what it
# needs, how its compare is made). Listed here so that the flag's help and its check need no torch.
ARM_NAMES = ("aligned_both", "aligned_trainer", "lm_head", "fp32_layers", "fp32_last_layers", "fp16",
             "train_kernels_vllm", "train_kernels_liger", "train_amp", "fp8_off", "routing_ids", "routing_ids_weights",
             "correction")
# Each arm is one full compare with its noise floors on the same prompts, plus its cost's repeats: the bound keeps a
# mistyped repeat count from running for hours, where the spread of a few repeats is already what the table needs.
MAX_COST_REPEATS = 50
MAX_BOOTSTRAP = 10_000  # as ablate's (spec/align.py): each draw recomputes every arm's change from per-prompt sums
# The arms that load stacks beside the shipped ones for their compare, and what: the memory plan counts them
# (runs/memory.py) so that a run they cannot fit is refused before anything loads.
LOADS_BESIDE = {"fp16": "a trainer and an engine in FP16", "train_amp": "a trainer with FP32 weights"}


def fp16_refusal(load) -> str | None:
    """Why the fp16 arm cannot run on this load, or None: it would change nothing, or two things at once."""
    if load.dtype == "float16":
        return "the run is FP16 already"
    if load.train_precision == "amp":
        return "--train-precision amp autocasts to --dtype; FP16 here would change two things at once"
    return None


def _arms(value) -> tuple[str, ...]:
    """--arms' comma list (a sequence from the Python API or a manifest) -> the arms in ARMS order. None or an empty
    sequence (--arms omitted, as a manifest records it) is every arm. A text naming no arm, with an empty item or
    naming an arm twice is refused: read leniently, it would run every arm, or other arms than the line seems to name."""
    if value is None or (not isinstance(value, str) and not value):
        return ()
    text = value if isinstance(value, str) else ",".join(value)
    names = [a.strip() for a in text.split(",")]
    if not any(names):
        raise ProbeError(f"--arms {text!r} names no arm; omit --arms to try every arm")
    if "" in names:
        raise ProbeError(f"--arms {text!r} has an empty item; drop the stray comma, or omit --arms to try every arm")
    unknown = [a for a in names if a not in ARM_NAMES]
    if unknown:
        raise ProbeError(f"--arms {unknown[0]!r} is not an arm; choose from: {', '.join(ARM_NAMES)}")
    repeated = next((a for i, a in enumerate(names) if a in names[:i]), None)
    if repeated:
        raise ProbeError(f"--arms names {repeated} twice; name each arm once")
    return tuple(a for a in ARM_NAMES if a in names)


@dataclass(frozen=True, kw_only=True)
class RemediesSpec:
    """The candidate remedies a run tries, each against the stacks as shipped on the same prompts."""

    arms: tuple[str, ...] = option((), "Arms to try (comma list; default: all): " + ", ".join(ARM_NAMES) + ". An arm "
                                       "the model or the device cannot run is listed as not run, with the reason.")
    fp32_layers: int = option(2, "fp32_layers arm: how many of the trainer's decoder layers run their norms, RoPE and "
                                 "SwiGLU in FP32: those whose residual stream diverges most in the shipped run "
                                 "(the largest rise of resid_out rel_l2), or the first k when it has no such reading. "
                                 "fp32_last_layers: as many, the last ones.")
    metric: str = option("mean_abs_dlogp", "The mismatch each arm's change is measured in: " + ", ".join(METRICS)
                                           + ". The noise floors are in mean |Δlogp|.")
    bootstrap: int = option(1000, f"Bootstrap resamples of prompts for each change's interval (0 = none; at most "
                                  f"{MAX_BOOTSTRAP:,}).")
    ci_level: float = option(0.95, "Confidence level of the intervals.")
    cost_repeats: int = option(3, f"Timed repeats of each side's step per arm (the trainer's forward, its forward and "
                                  f"backward, the engine's step); the cost is their median and its noise their spread "
                                  f"(1 to {MAX_COST_REPEATS}).")

    def __post_init__(self) -> None:
        check_finite(self)
        object.__setattr__(self, "arms", _arms(self.arms))
        if self.fp32_layers < 1:
            raise ProbeError(f"--fp32-layers must be at least 1, got {self.fp32_layers}")
        if self.metric not in METRICS:
            raise ProbeError(f"--metric {self.metric!r} is not valid; choose one of: {', '.join(METRICS)}")
        if not 0 <= self.bootstrap <= MAX_BOOTSTRAP:
            raise ProbeError(f"--bootstrap {self.bootstrap} is outside 0 to {MAX_BOOTSTRAP:,}; 1,000 give stable 95% "
                             "intervals")
        if not 0 < self.ci_level < 1:
            raise ProbeError("--ci-level must be in (0, 1), e.g. 0.95")
        if not 1 <= self.cost_repeats <= MAX_COST_REPEATS:
            raise ProbeError(f"--cost-repeats must be from 1 to {MAX_COST_REPEATS}, got {self.cost_repeats}")

    @property
    def chosen(self) -> tuple[str, ...]:
        """The arms to try: those named, or every arm."""
        return self.arms or ARM_NAMES
