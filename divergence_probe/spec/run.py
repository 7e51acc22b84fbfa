"""RunSpec: one frozen tree that says everything a run does; the CLI's flags and the manifest come from it.

    spec = RunSpec(kind="compare", load=LoadSpec(model="ckpt/"), capture=CaptureSpec(taps="none"))
    run = divergence_probe.run(spec)          # or: divergence-probe rerun RUN_DIR

Each component owns its fields, defaults and checks (`__post_init__`), so a bad flag fails before anything
loads, and every default lives in exactly one place: its component. Fields are declared with `options.option`, which
also carries the flag's help text; `cli/options.py` generates each command's options from these fields. The manifest
stores `spec.to_dict()`, and `RunSpec.from_dict` turns it back into the same spec, which is what `rerun` runs.
"""

from __future__ import annotations

from dataclasses import Field, asdict, dataclass, fields, replace
from typing import Any, Mapping

from ..engines import capabilities_of, knobs_of, parse_factor, stack_class
from ..engines.protocol import ENGINE_REGIONS, TRAINER_REGIONS, freeze_engine_args
from ..errors import ProbeError, StackError
from ..numerics.shapley import combo_name, subsets
from ..options import option
from ..regions import check_regions_exist, patched
from ..rundir import KINDS
from .align import AblateSpec, AlignSpec, unaligned
from .capture import SIGNIFICAND_BITS, CaptureSpec
from .fields import _choice, flag_of
from .from_manifest import _build, _fields_of, _hints, _SpecError, _typed
from .generate import GenerateSpec
from .knobs import applied
from .load import SHIPPED_KERNELS, LoadSpec
from .prompts import PromptSpec
from .remedies import LOADS_BESIDE, RemediesSpec, fp16_refusal


COMPONENTS = {"load": LoadSpec, "prompts": PromptSpec, "capture": CaptureSpec, "generate": GenerateSpec,
              "align": AlignSpec, "ablate": AblateSpec, "remedies": RemediesSpec}
# The components whose options a kind's command takes (flat_fields): remedies takes compare's model and prompt
# options and makes every arm's capture, alignment and factors itself (runs/remedies.py).
KIND_COMPONENTS = {"compare": ("load", "prompts", "capture", "generate", "align"),
                   "ablate": ("load", "prompts", "capture", "generate", "align", "ablate"),
                   "remedies": ("load", "prompts", "remedies")}
# What a remedies run reads per layer in its shipped compare: the fp32_layers arm picks its layers from it.
READING_TAP = "resid_out"


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run: a compare (one alignment setting) or an ablate (every subset of regions)."""

    kind: str = "compare"
    load: LoadSpec = option(default_factory=LoadSpec)
    prompts: PromptSpec = option(default_factory=PromptSpec)
    capture: CaptureSpec = option(default_factory=CaptureSpec)
    generate: GenerateSpec = option(default_factory=GenerateSpec)
    align: AlignSpec = option(default_factory=AlignSpec)
    ablate: AblateSpec | None = None
    """None for a compare."""
    remedies: RemediesSpec | None = None
    """None but for a remedies run."""
    report: bool = option(False, "After the run is written, render OUT/report (report.md and figures; see the "
                                 "report command).")

    def __post_init__(self) -> None:
        _choice(self.kind, KINDS, "kind")
        if self.kind == "ablate" and self.ablate is None:
            object.__setattr__(self, "ablate", AblateSpec())
        if self.kind == "compare" and self.ablate is not None:
            raise ProbeError("a compare run has no ablation; use kind 'ablate'")
        if self.kind == "remedies" and self.remedies is None:
            object.__setattr__(self, "remedies", RemediesSpec())
        if self.kind != "remedies" and self.remedies is not None:
            raise ProbeError(f"a {self.kind} run tries no remedies; use kind 'remedies'")
        if self.kind == "remedies" and self.load.placement == "alternate":
            raise ProbeError("remedies runs each arm beside the shipped stacks, both loaded at once; use --placement "
                             "together or auto")
        infer = capabilities_of(self.load.infer, engine=self.load.engine)  # here: the CLI's --help imports no torch
        not_captured = infer.not_captured()
        refused = sorted(self.capture.tap_names & set(not_captured)) if self.capture.taps.strip() != "all" else []
        if refused:  # `all` captures what the stack can and lists the rest in the manifest
            why = not_captured[refused[0]].removeprefix("not captured")
            raise ProbeError(f"taps {', '.join(refused)} cannot be captured{why}; or drop them from --taps")
        if not self.generate.generates:
            changed = [flag_of(f) for f in fields(GenerateSpec) if f.metadata.get("cli", True) and f.name != "mode"
                       and getattr(self.generate, f.name) != f.default]
            if changed:
                these = "they only apply" if len(changed) > 1 else "it only applies"
                raise ProbeError(f"{', '.join(changed)}: {these} with --mode generate; add --mode generate or drop "
                                 + ("them" if len(changed) > 1 else "it"))
        if self.generate.seed != self.load.seed:  # each request's seed derives from the run's one seed
            object.__setattr__(self, "generate", replace(self.generate, seed=self.load.seed))
        layer_taps = self.capture.tap_names - {"logits"}
        if self.load.train_precision == "amp" and (layer_taps or self.capture.graft or self.capture.depth):
            raise ProbeError("--train-precision amp keeps the trainer's residual stream, norms and RoPE in FP32, so its "
                             "layer taps cannot be paired with the engine's; add --taps none (or --taps logits) and "
                             "drop --graft/--depth")
        if (self.capture.graft or self.capture.depth) and self.load.train_device is not None and not _same_device(
                self.load.train_device, self.load.device):
            raise ProbeError(f"--graft/--depth run the trainer's ops on the engine's own tensors, which are on "
                             f"--device {self.load.device}, not --train-device {self.load.train_device}; drop "
                             "--train-device or --graft/--depth")
        self._check_trainer()
        reference = self.capture.reference
        if reference is not None and SIGNIFICAND_BITS[reference] <= SIGNIFICAND_BITS[self.load.dtype]:
            raise ProbeError(f"--reference {reference} is no finer than --dtype {self.load.dtype}, so both stacks would "
                             "be measured against their own precision; use --reference float64")
        if self.load.placement == "alternate" and self._graft_features():
            raise ProbeError(f"{'/'.join(self._graft_features())} run the trainer's ops on the engine's tensors as they "
                             "are made, which needs both stacks loaded at once; use --placement together")
        if self.load.placement == "alternate" and self.reference_replays_infer():
            raise ProbeError(f"--reference measures --infer {self.load.infer}'s own ops on the reference's inputs (its "
                             "local reading) in the trainer's pass, which needs it loaded beside the trainer; use "
                             "--placement together")
        refusal = infer.first_refused(self._graft_features())
        if refusal:  # a compiled engine's
            raise ProbeError(refusal)
        refusal = infer.first_refused(["--engine-noise"] if self.capture.engine_noise else [])
        if refusal:  # an inference stack without another engine mode
            raise ProbeError(refusal)
        if self.kind == "ablate" and self.align.regions:
            raise ProbeError("ablate aligns every subset of --regions itself; drop --align")
        regions = self.ablate.regions if self.kind == "ablate" else self.align.regions
        self._check_aligns(regions)
        if self.load.train_kernels != SHIPPED_KERNELS:
            stack_class(self.load.train).kernel_set(self.load.train_kernels).check_regions(regions, self.align.side)
        if "lm_head" in regions and self.align.side != "both" and (
                "logits" in self.capture.tap_names or self.capture.graft or self.capture.depth):
            raise ProbeError(f"lm_head on --side {self.align.side} alone makes one stack's logits FP32 and the other's "
                             f"{self.load.dtype}, so the logits tap cannot be paired; drop logits from --taps (e.g. "
                             "--taps none) and --graft/--depth, or use --side both")
        if "residual" in regions and self.align.side != "both" and (
                {"resid_mid", "resid_out"} & self.capture.tap_names or self.capture.graft):
            raise ProbeError(f"residual on --side {self.align.side} alone makes one stack's residual stream FP32 and "
                             f"the other's {self.load.dtype}, so the resid_mid/resid_out taps cannot be paired; drop "
                             "them from --taps (e.g. --taps none) and --graft, or use --side both")
        if "routing" in regions and self.align.side == "infer":
            raise ProbeError("routing is replayed from the engine into the trainer, so it has no --side infer; use "
                             "--side train or both, or leave routing out")
        if "routing" in regions and self.capture.depth:
            raise ProbeError("--depth continues the trainer's forward with its own router, while routing replay runs "
                             "the trainer on the engine's experts, so the depth curve would not end at the run's own "
                             "gap; drop --depth or leave routing out")
        if self.align.routing_replay != "ids" and "routing" not in regions:
            raise ProbeError("--routing-replay applies to the routing region only; add routing to "
                             + ("--regions" if self.kind == "ablate" else "--align") + " or drop --routing-replay")
        if self.kind == "ablate" and self.ablate.factors:  # every combination checked as its own run, before loading
            for label in self.ablate.factors:
                check_factor(label, self.load)
            for combo in subsets(self.ablate.players):
                try:
                    self.combination(combo)
                except ProbeError as e:
                    raise ProbeError(f"the combination {combo_name(combo, self.ablate.players)} cannot run: {e}") from None
        if self.kind == "ablate" and self.ablate.build_ahead and "kv_cache_memory_bytes" not in self.load.engine_args \
                and _resolved_device(self.load.device) != "cpu":
            raise ProbeError("--build-ahead on a GPU starts engines together, and vLLM's memory profiling would count "
                             "the other engines' allocations as its own; add --engine-args '{\"gpu_memory_utilization\": "
                             "0.1, \"kv_cache_memory_bytes\": 2000000000}' (sized for your model), or drop --build-ahead")

    def combination(self, combo) -> "RunSpec":
        """The compare one combination of an ablation runs: its regions aligned, its factors' load settings."""
        regions = tuple(r for r in self.ablate.regions if r in combo)
        replay = self.align.routing_replay if "routing" in regions else "ids"  # only a combination with routing replays
        load = applied(self.load, [f for f in self.ablate.factors if f in combo])
        return replace(self, kind="compare", ablate=None, remedies=None, load=load,
                       align=replace(self.align, regions=regions, routing_replay=replay))

    @property
    def engine_configuration(self) -> tuple:
        """What makes one engine pass of a run (--placement alternate): the engine's mode and arguments (an ablation's
        engine factors) and the regions aligned in it. Combinations that differ only on the trainer's side share one
        pass."""
        regions = tuple(patched(self.align.regions)) if self.align.side != "train" else ()
        return self.load.engine, freeze_engine_args(self.load.engine_args), regions

    def reference_replays_infer(self) -> bool:
        """--reference with an inference stack that replays its ops on captured inputs (Capabilities.grafts): the
        local reading runs it beside the reference, so it cannot have left the device (--placement alternate)."""
        return self.capture.reference is not None and capabilities_of(self.load.infer, engine=self.load.engine).grafts

    def _graft_features(self) -> list[str]:
        return [feature for feature, on in (("--graft", self.capture.graft), ("--depth", self.capture.depth)) if on]

    def _check_aligns(self, regions) -> None:
        """Each region patched on a stack is one its class declares it aligns (StackClass.aligns): refused here, in one
        line, before anything loads, rather than by the stack's patches once it is loaded."""
        refusal = unaligned(regions, self.load, self.align.side,
                            leave_out_of="--regions" if self.kind == "ablate" else "--align")
        if refusal:
            raise ProbeError(refusal)

    def _check_trainer(self) -> None:
        """What the trainer refuses (its Capabilities: one sharded over processes, engines/hf/tensor_parallel.py, runs
        no single op and takes no patch here), in one line."""
        regions = patched(self.ablate.regions if self.kind == "ablate" else self.align.regions)  # routing: replayed
        trainer_regions = [TRAINER_REGIONS] if regions and self.align.side != "infer" else []
        refusal = capabilities_of(self.load.train, ranks=self.load.train_tp).first_refused(
            [*self._graft_features(), *trainer_regions])
        if refusal:
            raise ProbeError(refusal)

    def to_dict(self) -> dict:
        """The spec as plain JSON data (the manifest's `spec`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunSpec":
        """The spec a manifest recorded, checked as the CLI checks its flags, before anything loads: a manifest is
        data anyone may have edited. Every field must be there (a default filled in would rerun another run than
        the one recorded; a field added since, LATER_FIELDS, takes the value that re-makes what older runs did), none
        may be unknown, each must have the type its flag parses to (no fractional count,
        no text for a bool), and then each component's own checks run. One ProbeError naming the field."""
        try:
            top = {f.name: f for f in fields(cls)}
            values = _fields_of(data, top, "spec")
            hints = _hints(cls)
            parts = {}
            for name, value in values.items():
                where = f"spec.{name}"
                if name in COMPONENTS:
                    parts[name] = None if value is None and name in ("ablate", "remedies") \
                        else _build(COMPONENTS[name], value, where)
                else:
                    parts[name] = _typed(value, hints[name], where, "--report" if name == "report" else name)
            try:
                return cls(**parts)
            except ProbeError as e:
                raise _SpecError(f"spec: {e}") from e
        except _SpecError as e:
            raise ProbeError(f"the recorded run spec does not fit this version of divergence-probe ({e}); fix the "
                             "manifest or re-run the command from its `command` instead") from None


def remedies_capture(load: LoadSpec) -> CaptureSpec:
    """What a remedies run captures in its shipped compare: the noise floors every arm's change stands beside, and the
    residual stream's per-layer readings where the stacks pair them (not from a compiled engine, nor from an AMP
    trainer, whose stream is FP32)."""
    readable = READING_TAP not in capabilities_of(load.infer, engine=load.engine).not_captured() \
        and load.train_precision != "amp"
    return CaptureSpec(taps=READING_TAP if readable else "none", batch_invariance=True)


def stacks_beside(spec: "RunSpec | None") -> tuple[str, ...]:
    """The arms of a remedies run that will load stacks beside the shipped ones (LOADS_BESIDE), those this load does
    not refuse: what its memory plan counts on top of the shipped stacks."""
    if spec is None or spec.kind != "remedies":
        return ()
    beside = []
    for arm in LOADS_BESIDE:
        if arm not in spec.remedies.chosen:
            continue
        if arm == "fp16" and fp16_refusal(spec.load) is None:
            beside.append(arm)
        elif arm == "train_amp":
            try:
                check_factor("train:precision=amp", spec.load)  # the arm's own check (runs/remedies.py _factor)
                beside.append(arm)
            except ProbeError:
                pass
    return tuple(beside)


def _resolved_device(device: str) -> str:
    from ..environment import resolve_device

    return resolve_device(device)


def _same_device(train_device: str, device: str) -> bool:
    from ..environment import resolve_train_device, same_device

    return same_device(resolve_train_device(train_device, device), _resolved_device(device))


def flat_fields(kind: str) -> list[tuple[str | None, Field, str]]:
    """(component, field, flat name) of every option a command of `kind` takes, in declaration order.

    The flat name is the flag without dashes (`--max-new-tokens` -> max_new_tokens); it is what the CLI's
    parameters and the keyword arguments of `Probe.compare`/`Probe.ablate` are called. Unique per kind."""
    out = []
    for component, cls in COMPONENTS.items():
        if component not in KIND_COMPONENTS[kind]:
            continue
        for f in fields(cls):
            if not f.metadata.get("cli", True) or (kind == "ablate" and component == "align" and f.name == "regions"):
                continue
            out.append((component, f, flag_of(f)[2:].replace("-", "_")))
    report = next(f for f in fields(RunSpec) if f.name == "report")
    out.append((None, report, "report"))
    return out


def spec_from_flat(kind: str, *, load: LoadSpec | None = None, **flat) -> RunSpec:
    """A RunSpec from flat option names (the CLI's, and the Python API's keyword arguments). `load`: the load settings
    of an already loaded probe, in place of flat load options (checks that involve the load see the real ones)."""
    table = {name: (component, f) for component, f, name in flat_fields(kind)}
    unknown = sorted(set(flat) - set(table))
    if unknown:
        raise ProbeError(f"unknown option(s) for {kind}: {', '.join(unknown)}; known: {', '.join(table)}")
    parts: dict[str, dict] = {}
    top = {}
    for name, value in flat.items():
        component, f = table[name]
        if component is None:
            top[f.name] = value
        else:
            parts.setdefault(component, {})[f.name] = value
    built = {component: COMPONENTS[component](**values) for component, values in parts.items()}
    if load is not None:
        if "load" in built:
            raise ProbeError("load options and a loaded probe's load settings at once; pass one or the other")
        built["load"] = load
    if kind == "ablate":
        built.setdefault("ablate", AblateSpec())
    if kind == "remedies":
        built.setdefault("remedies", RemediesSpec())
        built["capture"] = remedies_capture(built.get("load") or LoadSpec())
    return RunSpec(kind=kind, **built, **top)


def check_factor(label: str, load) -> None:
    """A factor against the run's own load settings, before anything loads: its knob's checker on the device, and a
    value the run already has (no change to attribute) refused."""
    from ..environment import resolve_device, resolve_train_device

    try:
        factor = parse_factor(label, load.infer, load.train)
    except ProbeError:
        if label.partition("=")[0].strip() in knobs_of(load.infer, load.train):
            raise  # a knob of the run's stacks, refusing the value
        knob = parse_factor(label).knob  # a knob of another stack than the run's on that side (or no knob: its line)
        flag, stack = ("--infer", load.infer) if knob.side == "engine" else ("--train", load.train)
        raise ProbeError(f"--factor {label} changes {stack_class(knob.owner).title}, but {flag} is {stack}; drop it or "
                         f"use {flag} {knob.owner}") from None
    knob = factor.knob
    device = resolve_device(load.device) if knob.side == "engine" else resolve_train_device(load.train_device,
                                                                                            load.device)
    if knob.change(factor.value, load) == getattr(load, knob.field):
        raise ProbeError(f"--factor {label} is what the run already runs; ablate a change (e.g. drop the matching "
                         "--train-*/--engine flag)")
    try:
        knob.check(factor.value, device)
        replace(load, **{knob.field: knob.change(factor.value, load)})  # the LoadSpec's own checks of the change
    except ProbeError as e:
        raise ProbeError(f"--factor {label}: {e}") from None


def check_family(run: "RunSpec | None", load: LoadSpec, family) -> None:
    """Refuse, before any stack loads, what the model's family cannot do yet (models/: `Family.unsupported`), regions
    its layers do not have, and what cannot run on an engine at tensor_parallel_size > 1 (engines/vllm/
    tensor_parallel.py: REFUSED)."""
    check_regions_exist(family, () if run is None else run.ablate.regions if run.kind == "ablate" else run.align.regions)
    if load.train_tp > 1 and family.top_k_field is not None:  # its experts' plan shards the routed tokens: not built
        raise ProbeError(f"--train-tp {load.train_tp} is built for dense models; {family.model_type} is a mixture of "
                         "experts; use --train-tp 1")
    wanted = []
    if load.engine == "compiled":  # another inference stack refuses --engine itself (StackClass.check_settings)
        wanted.append("--engine compiled")
    if run is not None:
        wanted += [f for f, on in (("--graft", run.capture.graft), ("--depth", run.capture.depth),
                                   ("--align", bool(run.align.regions)), ("ablate", run.kind == "ablate")) if on]
    ranks = load.engine_ranks
    if ranks > 1:
        wanted.append("tensor_parallel_size > 1")
    for feature in wanted:
        if feature in family.unsupported:
            raise ProbeError(f"{feature} {family.unsupported[feature]}; drop it for this model")
    engine_regions = run is not None and run.align.side != "train" and bool(
        run.ablate.regions if run.kind == "ablate" else run.align.regions)  # --align/ablate on the trainer alone
    refusal = capabilities_of(load.infer, engine=load.engine, ranks=ranks).first_refused(
        [*wanted, *([ENGINE_REGIONS] if engine_regions else []),
         *(["--mode generate"] if run is not None and run.generate.generates else [])])
    if refusal:
        raise StackError(refusal)
    if run is not None and run.kind == "ablate" and run.ablate.factors:
        # a factor's load settings (--factor engine:enforce_eager=false is --engine compiled) meet the checks its
        # flag meets, for every combination that loads them, before anything loads
        for combo in subsets(run.ablate.players):
            each = run.combination(combo)
            if each.load != load:
                try:
                    check_family(each, each.load, family)
                except ProbeError as e:
                    raise type(e)(f"the combination {combo_name(combo, run.ablate.players)} cannot run: {e}") from None
