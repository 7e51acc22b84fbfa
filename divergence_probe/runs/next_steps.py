"""The command to try after a run, from the run's own numbers: the last lines every command prints name the run
folder, its report and this step, so the next question a user has is one copy-paste away.

    step = after_compare(spec, summary, family)     # Step(argv, why) or None
    step = after_ablate(spec, attribution, family)
    step = after_score(call, load, summary)
    step = after_rl(spec, family)

The rules follow the README's recipes, in the order a user asks them: is the mismatch more than noise (measure a
floor), what should I change and at what cost (remedies; where it cannot run, which region or routing carries it:
ablate), what the trainer alone can adopt (--side train), and whether it matters in training (rl). A command the
model's family cannot run is never suggested: each candidate goes through the checks the command itself runs
before loading (spec.check_family: `Family.unsupported`, regions the family lacks, what tensor parallelism refuses;
rl: its settings' regions). Pure functions of the run: the same run gives the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ProbeError
from .rerun import command_line, rl_command_line, score_command_line
from ..numerics.noise_verdict import ABOVE, CANNOT_TELL, TOO_FEW, VERDICT, in_words
from ..numerics.rl_summary import DIFF_VERDICT, MOST_SEEDS, NOT_DETECTED, SEEDS_NEEDED
from ..numerics.shapley import EFFECT, MIN_PROMPTS, REMOVES

NUMERIC_REGIONS = ("rope", "swiglu", "rmsnorm")  # rl's setting with every one the family has, as the README's recipe
MOE_REGIONS = ("rope", "rmsnorm", "routing")  # ablate on a mixture of experts, as the README's recipe runs it


@dataclass(frozen=True)
class Step:
    argv: list[str]
    why: str


def _can(family, feature: str) -> bool:
    return family is None or feature not in family.unsupported


def _valid(make):
    """make() (a spec), or None when the change does not make a valid one."""
    try:
        return make()
    except ProbeError:
        return None


def _changed(spec, **changes):
    """spec with `changes` (component -> {field: value}) applied, or None when that is not a valid spec."""
    return _valid(lambda: replace(spec, **{name: replace(getattr(spec, name), **fields)
                                           for name, fields in changes.items()}))


def _as_ablate(spec, regions: tuple[str, ...] | None, taps: str):
    """The same model, prompts and load as a compare spec, as an ablate over `regions` (default: all)."""
    from ..spec.align import AblateSpec

    return _valid(lambda: replace(
        spec, kind="ablate", ablate=AblateSpec(**({"regions": regions} if regions else {})),
        align=replace(spec.align, regions=()),
        capture=replace(spec.capture, taps=taps, graft=False, depth=False, batch_invariance=False)))


def _as_remedies(spec):
    """The same model, prompts and load as a compare spec, as a remedies run over every arm (prefill mode)."""
    from ..spec.run import spec_from_flat

    return _valid(lambda: replace(spec_from_flat("remedies", load=spec.load), prompts=spec.prompts))


def _on_enough_prompts(spec, why: str):
    """`spec` on MIN_PROMPTS prompts where it takes fewer, and `why` saying so: below that a floor's verdict and a
    region's effect get no interval, so the step would answer nothing (a spec that takes a file's every prompt, or
    that is not valid with more, is left as it is)."""
    prompts = spec.prompts.num_prompts if spec is not None else None
    more = _changed(spec, prompts={"num_prompts": MIN_PROMPTS}) if prompts and prompts < MIN_PROMPTS else None
    if more is None:
        return spec, why
    return more, f"{why}, on {MIN_PROMPTS} prompts (fewer give no interval)"


def _runs_on(spec, family) -> bool:
    """Whether the command would get past its own pre-load checks for this family (None: not known, so yes)."""
    from ..spec.run import check_family

    return family is None or _valid(lambda: check_family(spec, spec.load, family) or True) is not None


def _step(spec, why: str, family=None) -> Step | None:
    return None if spec is None or not _runs_on(spec, family) else Step(command_line(spec), why)


def after_compare(spec, summary: dict, family=None) -> Step | None:
    """No floor: measure it, on enough prompts for an interval. Over its floor (the whole bootstrap interval of the
    ratio): which remedy removes it and at what cost (remedies); where remedies cannot run (one stack at a time),
    which region removes it, or on a MoE model whether routing or rounding carries it (ablate, with routing). Within
    its floor: what RL sees (generate mode), if not seen yet. An interval that straddles the floor: the same run on
    more prompts, which narrows it (when the run used only some of its prompts; otherwise the user has to bring
    more). A remedies run ends with its own ranking: no step."""
    if spec.kind == "remedies":
        return None
    verdict = summary.get(VERDICT)
    if verdict is None:
        return _step(*_on_enough_prompts(_changed(spec, capture={"batch_invariance": True}),
                                         "no noise floor was measured, so the mismatch cannot be told from noise"),
                     family)
    if verdict in (CANNOT_TELL, TOO_FEW):  # too few for an interval: at least MIN_PROMPTS; straddles: 4x as many
        prompts = spec.prompts.num_prompts
        more = _changed(spec, prompts={"num_prompts": max(MIN_PROMPTS, prompts * 4)}) if prompts else None
        return _step(more, in_words(summary), family) if more else None
    if verdict == ABOVE:
        why = in_words(summary)
        step = _step(_as_remedies(spec), why + ": which change removes it, and what it costs", family)
        if step is not None:
            return step
        if "frac_tokens_any_flip" in summary:  # a mixture of experts: routing is one more factor
            step = _step(_as_ablate(spec, MOE_REGIONS, spec.capture.taps) if _can(family, "ablate") else None,
                         why + ": split it into routing and rounding", family)
        if step is None and _can(family, "ablate"):
            step = _step(_as_ablate(spec, _regions_of(family), "none"), why + ": which aligned region removes it",
                         family)
        return step
    if not spec.generate.generates:
        return _step(_changed(spec, generate={"mode": "generate"}),
                     in_words(summary) + "; see what it does to sampled responses and the RL metrics", family)
    return None


def _regions_of(family) -> tuple[str, ...] | None:
    """The numeric regions this family's layers have (None: the defaults, family not known)."""
    if family is None:
        return None
    from ..regions import check_regions_exist

    return tuple(r for r in NUMERIC_REGIONS if _valid(lambda: check_regions_exist(family, [r]) or True))


def _rl_step(make, why: str, family=None) -> Step | None:
    """An rl command, if its spec is valid and the family has every region of its settings (rl's own check)."""
    from ..regions import check_regions_exist
    from ..spec.rl import parse_setting

    spec = _valid(make)
    if spec is None or family is not None and _valid(
            lambda: [check_regions_exist(family, parse_setting(s).regions) for s in spec.setting]) is None:
        return None
    return Step(rl_command_line(spec), why)


def after_ablate(spec, attribution, family=None) -> Step | None:
    """Aligned on both stacks: what the trainer alone can adopt, on enough prompts for an interval. On the trainer alone: whether the regions that
    removed mismatch matter in training (rl, shipped vs those regions, the trainer aligned); only a region whose
    whole interval removes mismatch (attribution.csv `effect`) counts: one the bootstrap cannot tell from no
    effect, or one without an interval, is no finding to train with."""
    if spec.align.side != "train":
        return _step(*_on_enough_prompts(_changed(spec, align={"side": "train"}), "what aligning the trainer alone "
                                         "(the engine as deployed) removes"), family)
    helped = ",".join(r.region for r in attribution.itertuples()
                      if r.region in spec.ablate.regions and getattr(r, EFFECT) == REMOVES)
    if not helped or not _can(family, "rl"):
        return None
    from ..spec.rl import rl_spec

    return _rl_step(lambda: rl_spec(model=spec.load.model, device=spec.load.device, setting=("none", helped),
                                    side="train"), f"whether aligning {helped} in the trainer changes training", family)


def after_score(call, load, summary: dict) -> Step | None:
    """Trainer only: split the gap (the engine's prefill). With the split: the engine's own mismatch on this model
    against its noise floor (a compare in generate mode with --batch-invariance)."""
    if call.infer is None:
        return Step(score_command_line(replace(call, infer="vllm"), load),
                    "split the gap into the engine's numerics and the decode path")
    from ..spec.generate import GenerateSpec
    from ..spec.run import RunSpec

    compare = _valid(lambda: RunSpec(load=replace(load, engine_args={}), generate=GenerateSpec(mode="generate"),
                                     capture=replace(RunSpec().capture, batch_invariance=True, taps="none")))
    return _step(compare, "the engine's own mismatch on this model, against its noise floor")


def after_rl(spec, family=None, summary=None) -> Step | None:
    """One setting: shipped against every region aligned in the trainer. Several settings on one seed: more seeds,
    to tell the settings apart from seed noise. Several seeds that did not separate the settings (rl_summary.csv's
    comparison, `summary`): the seeds a difference that large would need, when that is a number a run can reach."""
    if not spec.setting and _can(family, "rl"):
        aligned = ",".join(_regions_of(family) or NUMERIC_REGIONS)
        return _rl_step(lambda: replace(spec, align="none", setting=("none", aligned), side="train"),
                        "whether aligning the trainer changes training", family)
    if len(spec.setting) > 1 and spec.seeds == 1:
        return _rl_step(lambda: replace(spec, seeds=3), "tell the settings apart from seed noise", family)
    if len(spec.setting) > 1 and summary is not None and DIFF_VERDICT in summary:
        open_ = summary[summary[DIFF_VERDICT] == NOT_DETECTED][SEEDS_NEEDED].dropna()
        need = int(open_.max()) if len(open_) else 0
        if spec.seeds < need < MOST_SEEDS:
            return _rl_step(lambda: replace(spec, seeds=need), f"{spec.seeds} seeds did not separate the settings; "
                            f"a difference as large as the one measured would need about {need} (rl_summary.csv "
                            "seeds_needed)", family)
    return None
