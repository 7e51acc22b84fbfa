"""AlignSpec and AblateSpec: which regions run in FP32 until one rounding, on which stacks, and the ablation of
every subset of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..engines import capabilities_of, parse_factors, stack_class
from ..errors import ProbeError
from ..numerics.shapley import METRICS
from ..options import option
from ..regions import ALL_REGIONS, REGIONS, from_engine, parse_regions, patched
from .fields import _choice, check_finite

SIDES = ("both", "train", "infer")
# Each bootstrap resample recomputes the metric of every combination (2^k of them) from per-prompt sums, in this
# process, with no progress of its own: the bound keeps the longest (every region and factor) to minutes, where a
# mistyped count would run for days. Percentile intervals settle within a few thousand resamples.
MAX_BOOTSTRAP = 10_000
# Every combination of regions and factors is one full compare on the same prompts (an engine build too, for an
# engine factor or a compiled engine aligned), so the count doubles with each region or factor: the bound admits
# all six regions, or three with three factors, where a long list would run for days.
MAX_COMBINATIONS = 64
ROUTING_REPLAYS = ("ids", "ids+weights")


def _regions(value) -> tuple[str, ...]:
    return parse_regions(value if value is not None else ())


def unaligned(regions: Sequence[str], load, side: str, *, named: Mapping[str, str] | None = None,
              leave_out_of: str | None = None, sides: Sequence[str] = SIDES) -> str | None:
    """The line saying which of `regions` a stack patched on `side` (both, train or infer) cannot align, or None when
    each stack aligns them all. Asked of the stack's class (StackClass.aligns; for routing replay, which is wired, not
    patched, the trainer's declared Capabilities.replays_routes) for the stacks a LoadSpec (`load`) names, so a run is
    refused, or an arm not run, before anything loads, where importing a stack's patches would import its engine.
    `named`: how the line names each stack side ("infer", "train"), where the command has no --infer/--train flag to
    name it by. `leave_out_of`: the flag the regions came from; the line then ends with the fix, aligning on the other
    stack alone where the command's `sides` have that --side."""
    for stack_side, other in (("infer", "train"), ("train", "infer")):
        if side not in (stack_side, "both"):
            continue
        name = getattr(load, stack_side)
        cls = stack_class(name)
        where = named[stack_side] if named else f"--{stack_side} {name}"
        missing = [r for r in patched(regions) if r not in cls.aligns]
        replayed = from_engine(regions) if stack_side == "train" else ()
        if replayed and not capabilities_of(name, ranks=load.train_tp).replays_routes:
            sharded = f", --train-tp {load.train_tp}" if load.train_tp > 1 and not named else ""
            line = (f"{', '.join(replayed)} replays the engine's routes in the trainer, which {cls.title or name} "
                    f"({where}{sharded}) does not declare it can")
            fix = f"leave it out of {leave_out_of}{', or use --train-tp 1' if sharded else ''}"
            return f"{line}; {fix}" if leave_out_of else line
        if not missing:
            continue
        line = (f"{', '.join(missing)} cannot be aligned on {cls.title or name} ({where}), which aligns "
                f"{', '.join(cls.aligns) or 'no region'}")
        if leave_out_of is None:
            return line
        fixes = [f"leave {'them' if len(missing) > 1 else 'it'} out of {leave_out_of}",
                 *([f"align on the other stack alone (--side {other})"] if other in sides else [])]
        return f"{line}; {', or '.join(fixes)}"
    return None


@dataclass(frozen=True, kw_only=True)
class AlignSpec:
    """Regions computed in FP32 until one rounding at their output, and on which stacks."""

    regions: tuple[str, ...] = option((), "Regions to align (FP32 until the output, one rounding): comma list of "
                                          + ", ".join(REGIONS) + ".", flag="--align")
    side: str = option("both", "Where regions are aligned: both, train (transformers only; the engine as shipped) "
                               "or infer.")
    routing_replay: str = option("ids", "With the routing region (MoE): what the trainer takes from the engine. ids: "
                                        "the engine's experts for every token and layer, the trainer's own gate "
                                        "weights for them (R3, as verl and Megatron replay routes); ids+weights: the "
                                        "engine's gate weights too.")

    def __post_init__(self) -> None:
        check_finite(self)
        object.__setattr__(self, "regions", _regions(self.regions))
        _choice(self.side, SIDES, "--side")
        _choice(self.routing_replay, ROUTING_REPLAYS, "--routing-replay")


@dataclass(frozen=True, kw_only=True)
class AblateSpec:
    """Every subset of `regions` aligned (on the AlignSpec's side), and the attribution of the mismatch."""

    regions: tuple[str, ...] = option(ALL_REGIONS, "Regions to ablate; all 2^k subsets run.")
    factors: tuple[str, ...] = option((), "Deployment knobs to ablate beside the regions, SIDE:KEY=VALUE (repeat the "
                                          "flag or give a comma list): engine:kv_cache_dtype=fp8, "
                                          "engine:quantization=fp8, engine:enforce_eager=false, "
                                          "train:kernels=vllm|liger, train:precision=amp. Every subset of regions and "
                                          "factors runs; a factor that changes the engine builds another one.",
                                      flag="--factor", repeat=True)
    metric: str = option("mean_kl", "What attribution explains: " + ", ".join(METRICS) + ".")
    bootstrap: int = option(1000, f"Bootstrap resamples of prompts for confidence intervals (0 = none; at most "
                                  f"{MAX_BOOTSTRAP:,}).")
    ci_level: float = option(0.95, "Confidence level of the bootstrap intervals.")
    build_ahead: int | None = option(None, "With a compiled engine aligned per combination: how many combinations' "
                                           "engines build in worker processes while the current one runs. Default: 1 "
                                           "on the CPU, 0 on a GPU (each engine reserves GPU memory; on a GPU, N > 0 "
                                           "needs --engine-args with a small gpu_memory_utilization and "
                                           "kv_cache_memory_bytes, since engines starting together would read each "
                                           "other's allocations as their own in vLLM's memory profiling).")

    def __post_init__(self) -> None:
        check_finite(self)
        object.__setattr__(self, "regions", _regions(self.regions))
        object.__setattr__(self, "factors", parse_factors(self.factors))
        if self.build_ahead is not None and self.build_ahead < 0:
            raise ProbeError("--build-ahead must be >= 0")
        if not self.regions:
            raise ProbeError("--regions is empty; name at least one region")
        if 2 ** len(self.players) > MAX_COMBINATIONS:
            raise ProbeError(f"ablate would run {2 ** len(self.players):,} combinations ({len(self.regions)} regions "
                             f"and {len(self.factors)} factors), over the {MAX_COMBINATIONS} it runs at most, each a "
                             "full compare; ablate fewer with --regions and --factor, or split them over runs")
        builds = 2 ** len(self.players) - 1  # every combination but the shipped one builds an engine
        if self.build_ahead is not None and self.build_ahead > builds:  # more would only start nothing, slowly
            raise ProbeError(f"--build-ahead {self.build_ahead} is more than the {builds} engine builds of "
                             f"{len(self.players)} regions and factors; use 0 to {builds}")
        _choice(self.metric, tuple(METRICS), "--metric")
        if not 0 <= self.bootstrap <= MAX_BOOTSTRAP:
            raise ProbeError(f"--bootstrap {self.bootstrap} is outside 0 to {MAX_BOOTSTRAP:,}: each resample "
                             f"recomputes all {2 ** len(self.players)} combinations' metric, so {MAX_BOOTSTRAP:,} "
                             "already take minutes (docs/reference/errors.md); 1,000 give stable 95% intervals")
        if not 0 < self.ci_level < 1:
            raise ProbeError("--ci-level must be in (0, 1), e.g. 0.95")

    @property
    def players(self) -> tuple[str, ...]:
        """What the attribution splits the change among: the regions, then the factors' labels."""
        return self.regions + self.factors
