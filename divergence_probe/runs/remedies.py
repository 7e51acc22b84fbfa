"""remedies: which change to make, and what it costs. Every candidate remedy (an arm) runs as its own compare on the
same prompts beside the stacks as shipped, with its own noise floors; its change of the mismatch gets a paired
bootstrap interval over prompts, and its cost (the time and peak memory each side's step adds) is measured on the
same loaded stacks, each side in the process that runs it. Arms whose interval holds zero are "no detectable effect" and are not ranked.

    run = probe.run(spec_from_flat("remedies", load=probe.config, arms="aligned_both,fp32_layers"))
    run.table            # remedies.csv: one row per arm, run or not (and why not)

An arm is a change a deployment can make, declared once in ARMS with the published claim it tests and what it needs
(the trainer only, an engine setting, or both). Most are the regions and factors ablate already toggles (knobs.py,
regions/), configured the way ablate configures a combination; the rest are this command's own: both stacks in FP16
(a second trainer and engine in FP16, against their own FP16 floors), the trainer's k most divergent layers in FP32
(engines/hf/patches/layers.py; the layers read from the shipped run's residual stream) against its last k layers in
FP32, and MoE routing replay of expert ids alone against ids plus the engine's combine weights; each pair is compared
directly too, on the same prompt draws.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pandas as pd

from .combination import configured
from .compare import CompareRun, run_compare
from .manifest import build_manifest
from .out_of_memory import is_out_of_memory
from .progress import Progress, phase
from .remedy_cost import SIDES, STEPS, measure_cost, pooled
from ..errors import ProbeError, StackError
from ..numerics.noise_verdict import RATIO, VERDICT, manifest_record
from ..numerics.remedies import NOT_RUN, RAN, ranked, ranking_lines
from ..numerics.shapley import METRICS, NO_INTERVAL, SHIPPED, bootstrap, effect, per_prompt
from ..numerics.tables import NOISE_FLOORS, largest_noise_floor
from ..reports.remedies import paired_lines
from ..spec.align import unaligned
from ..spec.knobs import applied
from ..spec.remedies import fp16_refusal
from ..spec.run import READING_TAP, RunSpec, check_factor, check_family

TRAINER, ENGINE, BOTH = "trainer only", "engine setting", "both"
SCORING = f"{TRAINER}, scoring side: cannot train"  # `needs` of a trainer arm whose kernel set has no backward
NUMERIC = ("rope", "swiglu", "rmsnorm")  # the published alignment: what a dense layer has of them, aligned


class NotRun(ProbeError):
    """An arm this model, device or run cannot try: listed with the reason, never dropped."""


@dataclass(frozen=True)
class Arm:
    name: str
    claim: str  # the published claim it tests
    needs: str  # TRAINER, ENGINE or BOTH: what adopting it changes
    step: Callable[[RunSpec, object], RunSpec]  # (the shipped compare, the model's family) -> the arm's compare
    paired_with: str | None = None  # an arm it is also compared with directly, on the same prompt draws
    # the trainer's decoder layers it runs in FP32, chosen from (the shipped run's layers.csv, k, the model's layers):
    # (the layers, how they were chosen); None for an arm that patches no layers
    layers: Callable[[pd.DataFrame, int, int], tuple[tuple[int, ...], str]] | None = None


def _regions_of(family, wanted) -> tuple[str, ...]:
    from ..regions import check_regions_exist

    has = []
    for region in wanted:
        try:
            check_regions_exist(family, [region])
            has.append(region)
        except ProbeError:
            pass
    return tuple(has)


def _aligned(side: str, regions=NUMERIC, replay: str = "ids"):
    def step(base: RunSpec, family) -> RunSpec:
        found = _regions_of(family, regions)
        if not found:
            raise NotRun(f"{family.model_type} models have none of {', '.join(regions)}")
        _check_alignable(base, found, side)
        return replace(base, align=replace(base.align, regions=found, side=side, routing_replay=replay))
    return step


def _factor(label: str):
    def step(base: RunSpec, family) -> RunSpec:
        try:
            check_factor(label, base.load)  # the knob's own check on this device (Liger: CUDA and its package)
        except ProbeError as e:
            raise NotRun(str(e).removeprefix(f"--factor {label}: ")) from None
        return replace(base, load=applied(base.load, [label]))
    return step


def _fp16(base: RunSpec, family) -> RunSpec:
    refusal = fp16_refusal(base.load)
    if refusal:
        raise NotRun(refusal)
    return replace(base, load=replace(base.load, dtype="float16"))


def _fp8_off(base: RunSpec, family) -> RunSpec:
    from ..engines import knobs_of

    args = base.load.engine_args
    fp8 = {knob.key for knob in knobs_of(infer=base.load.infer).values()  # the engine's own knobs (none for hf)
           if knob.side == "engine" and knob.field == "engine_args" and "fp8" in str(args.get(knob.key, ""))}
    if not fp8:
        raise NotRun("the engine runs no FP8 (no kv_cache_dtype or quantization in --engine-args): nothing to turn "
                     "off" + ("" if base.load.device == "cuda" else "; FP8 in vLLM needs a GPU"))
    return replace(base, load=replace(base.load, engine_args={k: v for k, v in base.load.engine_args.items()
                                                              if k not in fp8}))


def _routing(replay: str):
    def step(base: RunSpec, family) -> RunSpec:
        if family.top_k_field is None:
            raise NotRun(f"{family.model_type} is a dense model: no router to replay")
        return _aligned("train", ("routing",), replay)(base, family)
    return step


def _fp32_layers(base: RunSpec, family) -> RunSpec:
    from ..engines import capabilities_of
    from ..engines.protocol import TRAINER_REGIONS

    refusal = capabilities_of(base.load.train, ranks=base.load.train_tp).first_refused([TRAINER_REGIONS])
    if refusal:
        raise NotRun(refusal)
    _check_alignable(base, _regions_of(family, NUMERIC), "train")
    return base  # the layers are patched by run_remedies, not by an aligned region


def _check_alignable(base: RunSpec, regions, side: str) -> None:
    """An arm whose regions a stack on its side does not declare it aligns (StackClass.aligns) is not run, with the
    line compare refuses them in (without its fix: remedies has no flag naming regions), known from the stacks' classes
    before any stack is configured for the arm."""
    refusal = unaligned(regions, base.load, side)
    if refusal:
        raise NotRun(refusal)


# ---------------------------------------------------------------------------------------------- layers
def divergent_layers(layers: pd.DataFrame, k: int, num_layers: int) -> tuple[tuple[int, ...], str]:
    """The k layers whose residual stream's divergence rises most (the shipped run's resid_out rel_l2 minus the layer
    before's), and how they were chosen; the first k when the run has no such reading."""
    k = min(k, num_layers)
    rows = layers[layers["tap"] == READING_TAP].sort_values("layer") if len(layers) else layers
    if not len(rows):
        return tuple(range(k)), f"the first {k} (the shipped run has no {READING_TAP} reading)"
    rise = rows["rel_l2"].diff().fillna(rows["rel_l2"]).to_numpy()
    order = sorted(range(len(rows)), key=lambda i: (-rise[i], i))[:k]  # ties: the earlier layer
    chosen = tuple(sorted(int(rows["layer"].iloc[i]) for i in order))
    return chosen, f"the {k} with the largest rise of {READING_TAP} rel_l2 in the shipped run"


def last_layers(layers: pd.DataFrame, k: int, num_layers: int) -> tuple[tuple[int, ...], str]:
    """The last k layers, whatever the shipped run read: the choice the divergent one is measured against."""
    k = min(k, num_layers)
    return tuple(range(num_layers - k, num_layers)), f"the last {k}"


def arm_layers(arm: Arm, choices: dict) -> tuple[int, ...]:
    """The layers `arm` runs in FP32, from `choices` (arm name -> its layers and how they were chosen, for the arms the
    run runs); none for an arm that patches none. One whose layers are those of the arm it is paired with would run
    that arm again and pair it with itself: it is not run. Its pair not run, nothing is repeated: it runs."""
    if arm.layers is None:
        return ()
    layers = choices[arm.name][0]
    other = choices.get(arm.paired_with)
    if other is not None and set(layers) == set(other[0]):
        raise NotRun(f"its layers ({', '.join(map(str, layers))}) are those {arm.paired_with} chose ({other[1]}): "
                     f"the same arm; {arm.paired_with}'s row is its result")
    return layers


def _correction(base: RunSpec, family) -> RunSpec:
    raise NotRun("TIS/MIS reweight the policy loss and leave both stacks' logprobs as they are, so there is no "
                 "change in the mismatch to measure; their effect on training: rl --setting train:correction=tis")


ARMS = {arm.name: arm for arm in (
    Arm("aligned_both", "FP32 RoPE, SwiGLU and RMSNorm with one rounding on both stacks close the gap (the published "
        "alignment)", BOTH, _aligned("both")),
    Arm("aligned_trainer", "the same alignment in the trainer alone narrows the gap with the engine as deployed",
        TRAINER, _aligned("train")),
    Arm("lm_head", "an FP32 LM head (FP32 logits on both stacks) removes much of the gap", BOTH,
        _aligned("both", ("lm_head",))),
    Arm("fp32_layers", "upcasting the layers with the largest divergence increment beats upcasting the last ones",
        TRAINER, _fp32_layers, layers=divergent_layers),
    Arm("fp32_last_layers", "the last layers in FP32, the usual choice, leave more mismatch than fp32_layers' most "
        "divergent ones", TRAINER, _fp32_layers, paired_with="fp32_layers", layers=last_layers),
    Arm("fp16", "scoring and rollouts in FP16 remove a BF16 trainer's out-of-band tokens at about BF16's cost", BOTH,
        _fp16),
    Arm("train_kernels_vllm", "the engine's own RMSNorm, SiLU-and-mul and rotary kernels in the trainer leave only "
        "GEMMs and attention different", TRAINER, _factor("train:kernels=vllm")),
    Arm("train_kernels_liger", "Liger-Kernel's RMSNorm, RoPE and SwiGLU, as verl, OpenRLHF and TRL enable it",
        TRAINER, _factor("train:kernels=liger")),
    Arm("train_amp", "AMP / FSDP mixed precision in the trainer (FP32 master weights, norms and RoPE in FP32)",
        TRAINER, _factor("train:precision=amp")),
    Arm("fp8_off", "an FP8 KV cache or FP8 weights widen the gap; turning FP8 off closes it", ENGINE, _fp8_off),
    Arm("routing_ids", "replaying the engine's expert ids in the trainer (R3) removes routing's share of the gap",
        BOTH, _routing("ids")),
    Arm("routing_ids_weights", "replaying ids plus the engine's combine weights removes more than ids alone", BOTH,
        _routing("ids+weights"), paired_with="routing_ids"),
    Arm("correction", "TIS/MIS importance weights correct the gap in the loss", TRAINER, _correction),
)}


# ---------------------------------------------------------------------------------------------- the run
def _release(device: str) -> None:
    """What a closed arm's stacks (or the shipped run's temporaries) left in this process goes back to the device, so
    that the next arm's stacks, and an engine starting in another process, find it free: vLLM checks at start-up
    that its share of the GPU is free, and memory this process's allocator keeps cached is not."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


@dataclass
class RemediesRun:
    spec: RunSpec
    shipped: CompareRun
    runs: dict  # arm name -> CompareRun; the shipped stacks first, as `none` (ablate's name for them)
    table: pd.DataFrame  # remedies.csv
    manifest: dict = field(default_factory=dict)

    @property
    def summary(self) -> dict:
        """The stacks as shipped: what the run's verdict and a --fail-if gate read."""
        return self.shipped.summary

    @property
    def prompts(self):
        return self.shipped.prompts

    @property
    def tap_stats(self) -> dict:
        """The shipped run's per-tap readings (what rerun's summary table reads)."""
        return self.shipped.tap_stats

    @property
    def threshold(self) -> float:
        return self.shipped.threshold

    def _stacked(self, table: str) -> pd.DataFrame:
        frames = [getattr(run, table).assign(combo=name) for name, run in self.runs.items()
                  if getattr(run, table) is not None]
        return pd.concat(frames, ignore_index=True)[["combo", *getattr(self.shipped, table).columns]]

    def files(self) -> dict[str, pd.DataFrame]:
        return {"remedies.csv": self.table, "tokens.csv": self._stacked("tokens_table"),
                "layers.csv": self.shipped.layers_table,
                "summary.csv": pd.DataFrame([{"combo": name, **run.summary} for name, run in self.runs.items()]),
                "batch_invariance.csv": self._stacked("batch_invariance")}

    def write(self, out_dir: str | Path) -> Path:
        from ..rundir import write_run

        return write_run(Path(out_dir), self.manifest | manifest_record(self.summary), self.prompts, self.files())

    def lines(self) -> list[str]:
        """What the command prints: the ranking, the arms without a detectable effect or not run, and each paired
        comparison, in the report's words."""
        options = self.spec.remedies
        return [*ranking_lines(self.table, options.metric),
                *paired_lines(self.table, options.metric, f"{100 * options.ci_level:g}%", code=str)]


@contextmanager
def _arm_view(probe, step: RunSpec, layers: tuple[int, ...]) -> Iterator[object]:
    """The loaded stacks as the arm runs them: FP16 loads both stacks again beside the shipped ones; fp32_layers and
    fp32_last_layers patch their layers of the trainer (the numeric regions its family has); every other arm is
    configured as ablate configures a combination."""
    from ..engines.hooks import HookSet

    with ExitStack() as stack:
        if step.load.dtype != probe.config.dtype:
            yield _fp16_view(probe, step, stack)
        elif layers:
            stack.enter_context(HookSet()).apply(probe.train.layers_aligned(layers,
                                                                            _regions_of(probe.source.family, NUMERIC)))
            yield probe
        else:
            yield stack.enter_context(configured(probe, step, None))


def _fp16_view(probe, step: RunSpec, stack: ExitStack):
    """Both stacks in the arm's dtype: another trainer, and another engine (in a worker process where the stack builds
    one there, as vLLM, whose CPU backend hosts one engine per process; else beside the first in this process)."""
    from ..engines import stack_class

    view = probe.with_trainer(dtype=step.load.dtype)
    stack.callback(view.train.close)
    kind = stack_class(probe.config.infer)
    settings = _fp16_engine_settings(probe, step)
    engine = kind.for_settings(settings, () if kind.workers else None)  # vLLM's CPU backend: one engine a process
    stack.callback(engine.close)  # a worker that fails to start, or an arm that fails, stops its process
    _release(probe.settings.device)  # the trainer's load temporaries: the engine's start checks its share is free
    engine.load(settings)
    return replace(view, infer=engine, owns_infer=False, settings=replace(view.settings, dtype=settings.dtype))


def _fp16_engine_settings(probe, step: RunSpec):
    """The FP16 engine's settings: the shipped engine's as the memory plan made them, in the arm's dtype. On a GPU
    they hold the plan's KV budget and the engine's share of the device (kv_cache_memory_bytes,
    gpu_memory_utilization), which a second engine needs to start beside the first: the plan counts it (arm_fp16)."""
    from .side_settings import TORCH_DTYPES, engine_settings, engine_settings_for

    return engine_settings(replace(engine_settings_for(probe.config, probe.settings, step.load),
                                   dtype=TORCH_DTYPES[step.load.dtype]))


def _arm_failed(error: Exception, device: str) -> str:
    """Why an arm that failed once loaded is not run: a stack that refuses it (a seam this version moved), or no room
    on the device for what it loads or runs (the shipped run and the other arms are kept). Anything else is raised."""
    if isinstance(error, StackError):
        return str(error)
    if not is_out_of_memory(error):
        raise error
    from ..errors import one_line

    return (f"out of {device} memory while the arm ran ({type(error).__name__}: {one_line(error, 160)}); its stacks "
            "were closed and the other arms ran. Try it alone (--arms), or a lower --batch-tokens")


def plan_arms(spec: RunSpec, family) -> tuple[dict[str, RunSpec], dict[str, str]]:
    """Each arm the remedies run `spec` chooses: its compare (the shipped one with no taps: its floors), or why the
    arm is not run. Decided from the spec, the stacks' classes and the model's family alone, so it needs no loaded
    stack: a run none of whose arms can run is refused here, in one line with each arm's reason, before its stacks
    load (runs/probe.py asks once the model is resolved), where it would run the shipped compare to rank nothing."""
    base = replace(spec, kind="compare", remedies=None, capture=replace(spec.capture, taps="none"))
    planned, reasons = {}, {}
    for name in spec.remedies.chosen:
        try:
            step = ARMS[name].step(base, family)
            check_family(step, step.load, family)
        except ProbeError as e:
            reasons[name] = str(e)
            continue
        planned[name] = step
    if not planned:
        fix = ("choose arms this model and these stacks can run with --arms, or omit --arms to try every arm"
               if spec.remedies.arms else "change what the reasons name")
        raise ProbeError(f"no chosen arm can run: {' | '.join(f'{name}: {why}' for name, why in reasons.items())}; "
                         f"{fix}")
    return planned, reasons


def run_remedies(probe, spec: RunSpec, progress: Progress | None = None, *, steps=STEPS) -> RemediesRun:
    """The arms planned (plan_arms: those the model or the stacks cannot run are not run, with why), the shipped
    compare (its floors and per-layer readings), then every planned arm's compare and cost. `steps`: the timed step of
    each side (tests slow one down)."""
    options = spec.remedies
    family = probe.source.family
    shipped_spec = replace(spec, kind="compare", remedies=None)
    chosen = options.chosen
    planned, reasons = plan_arms(spec, family)  # no stack needed: known before the shipped compare
    scale = len(chosen) + 1  # the shipped run and every arm's: one bar over the prompts of all
    phase(progress, "the stacks as shipped", scale=scale)
    shipped = run_compare(probe, shipped_spec, progress, total_scale=scale)
    done = len(shipped.prompts)
    first_cost = measure_cost(probe, shipped.prompts, options.cost_repeats, steps)
    choices = {name: arm.layers(shipped.layers_table, options.fp32_layers, probe.source.num_layers)
               for name, arm in ARMS.items() if arm.layers}
    runs, costs, records = {SHIPPED: shipped}, {}, {}
    for i, name in enumerate(chosen):
        if name not in planned:
            continue
        arm, step = ARMS[name], planned[name]
        try:
            layers = arm_layers(arm, {other: choices[other] for other in planned if other in choices})
        except ProbeError as e:
            reasons[name] = str(e)
            continue
        phase(progress, f"arm {name} ({i + 1}/{len(chosen)})", offset=done, scale=scale)
        _release(probe.settings.device)  # the shipped run's or the last arm's: its stacks are closed by now
        try:
            with _arm_view(probe, step, layers) as view:
                runs[name] = run_compare(view, step, progress, done_before=done, total_scale=scale)
                costs[name] = measure_cost(view, shipped.prompts, options.cost_repeats, steps)
        except Exception as e:
            reasons[name] = _arm_failed(e, probe.settings.device)
            runs.pop(name, None)
            continue
        done += len(shipped.prompts)
        records[name] = {"load": runs[name].manifest["load"], "align": {"regions": list(step.align.regions),
                                                                         "side": step.align.side,
                                                                         "routing_replay": step.align.routing_replay}}
        if layers:  # aligned by its own patch, in those layers of the trainer alone
            records[name]["align"] |= {"regions": list(_regions_of(family, NUMERIC)), "side": "train"}
            records[name]["layers"] = list(layers)
            records[name]["layer_choice"] = choices[name][1]
    _release(probe.settings.device)
    shipped_cost = pooled(first_cost, measure_cost(probe, shipped.prompts, options.cost_repeats, steps))
    table = remedies_table(runs, costs, shipped_cost, reasons, chosen, options, spec.load.seed)
    section = {"metric": options.metric, "bootstrap": options.bootstrap, "ci_level": options.ci_level,
               "seed": spec.load.seed, "cost_repeats": options.cost_repeats, "arms": records,
               "not_run": {name: reasons[name] for name in chosen if name in reasons},
               **{name: {"k": options.fp32_layers, "layers": list(layers), "choice": choice}
                  for name, (layers, choice) in choices.items()},
               "cost": {"device": probe.settings.device, "sides": list(SIDES),
                        "shipped": "measured before the arms and again after them",
                        "shipped_engine_step_timed_in": shipped_cost["engine_step_timed_in"]}}
    manifest = build_manifest("remedies", shipped.manifest, {"remedies": section}, spec=spec.to_dict())
    return RemediesRun(spec, shipped, runs, table, manifest)


# ---------------------------------------------------------------------------------------------- the table
def remedies_table(runs: dict, costs: dict, shipped_cost: dict, reasons: dict, chosen, options, seed: int
                   ) -> pd.DataFrame:
    """remedies.csv: one row per chosen arm in ARMS order, run or not; each run arm's change of the metric against
    the shipped stacks with its paired bootstrap interval, its floor, its cost added on each side; then the ranks."""
    fn = METRICS[options.metric]
    prompts = {name: per_prompt(run.tokens_table) for name, run in runs.items()}
    ran = [n for n in chosen if n in runs]

    def statistics_of(weights: np.ndarray) -> dict[str, float]:
        value = {name: fn(p, weights) for name, p in prompts.items()}
        base = value[SHIPPED]
        out = {}
        for name in ran:
            out[name] = value[name] - base
            out[name + "/share"] = (value[name] - base) / base if base else float("nan")
            other = ARMS[name].paired_with
            if other in value:
                out[name + "/paired"] = value[name] - value[other]
        return out

    point = statistics_of(np.ones(len(prompts[SHIPPED])))
    ci = bootstrap(len(prompts[SHIPPED]), statistics_of, options.bootstrap, seed, options.ci_level) \
        if options.bootstrap else {k: (float("nan"), float("nan")) for k in point}
    shipped_summary = runs[SHIPPED].summary
    shipped_value = fn(prompts[SHIPPED], np.ones(len(prompts[SHIPPED])))
    rows = []
    for name in chosen:
        arm = ARMS[name]
        row = {"arm": name, "claim": arm.claim, "needs": arm.needs, "status": RAN if name in runs else NOT_RUN,
               "reason": reasons.get(name, ""), "metric": options.metric, "shipped": shipped_value}
        if arm.paired_with:  # on a paired arm not run too: the comparison it leaves out is read with its reason
            row["paired_with"] = arm.paired_with
        if name not in runs:
            rows.append(row)
            continue
        summary = runs[name].summary
        low, high = ci[name]
        floor = largest_noise_floor(summary)
        row |= {"value": row["shipped"] + point[name], "change": point[name], "change_ci_low": low,
                "change_ci_high": high, "share": point[name + "/share"], "share_ci_low": ci[name + "/share"][0],
                "share_ci_high": ci[name + "/share"][1], "effect": effect(low, high),
                "floor": NOISE_FLOORS[floor[0]] if floor else "", "floor_mean_abs_dlogp": floor[1] if floor else
                float("nan"), "mismatch_over_floor": summary.get(RATIO, float("nan")),
                "verdict": summary.get(VERDICT, ""),
                "shipped_mismatch_over_floor": shipped_summary.get(RATIO, float("nan"))}
        if arm.paired_with:
            key = name + "/paired"
            row |= {"paired_change": point.get(key, float("nan")),
                    "paired_ci_low": ci.get(key, (float("nan"),) * 2)[0],
                    "paired_ci_high": ci.get(key, (float("nan"),) * 2)[1],
                    "paired_effect": effect(*ci[key]) if key in ci else NO_INTERVAL}
        cost = costs[name]
        if not cost["trains"]:  # its effect is the scoring forward's; the step that trains runs as shipped
            row["needs"] = SCORING
        for side in SIDES:
            row[f"{side}_s"] = cost[f"{side}_s"]
            row[f"{side}_spread_s"] = cost[f"{side}_spread_s"]
            row[f"{side}_added_s"] = cost[f"{side}_s"] - shipped_cost[f"{side}_s"]
            row[f"{side}_shipped_spread_s"] = shipped_cost[f"{side}_spread_s"]
            row[f"{side}_peak_added_bytes"] = cost[f"{side}_peak_bytes"] - shipped_cost[f"{side}_peak_bytes"]
            if f"{side}_note" in cost:
                row[f"{side}_note"] = cost[f"{side}_note"]
        row["engine_step_timed_in"] = cost["engine_step_timed_in"]
        row["train_weights_added_bytes"] = cost["train_weights_bytes"] - shipped_cost["train_weights_bytes"]
        # the sides the arm has: one that cannot train adds nothing to the step that trains, which runs as shipped
        row["step_added_s"] = float(np.nansum([row[f"{side}_added_s"] for side in SIDES]))
        rows.append(row)
    return ranked(pd.DataFrame(rows))
