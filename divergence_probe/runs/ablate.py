"""ablate: rerun compare with every subset of regions aligned and of deployment factors set, and attribute the mismatch
to them.

Each model is loaded once; between runs the region patches and the trainer's kernel set are toggled (they are
reversible and never touch weights). A factor that changes what is loaded (another engine configuration, the trainer
in another precision) gets its stack loaded beside the run's own for its combinations (knobs.py). Prompts, taps and
every other option are the same in every run, so the runs differ in the aligned regions and the factors alone.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import pandas as pd

from .batch_invariance import NoiseEngines
from .combination import configured, needs_worker, start_worker, trainer_configured
from .compare import CompareRun, run_compare
from .manifest import build_manifest
from .progress import Progress, phase
from .side_settings import engine_settings_for
from .reference import reference_arm
from .engine_align import stacks_for  # noqa: F401 (stacks_for: API)
from ..numerics.noise_verdict import manifest_record
from ..engines.patching import aligned
from ..numerics.shapley import DISAGREE, EFFECT, METRICS, OTHER_METRIC, SHARE, attribution, bootstrap_intervals, \
    combo_name, disagree, effect, per_prompt, subsets
from ..spec.run import RunSpec


GAP = "captured_logits_vs_reported_logprobs_max_gap"  # the inference stack's logits check, per run


@dataclass
class AblationRun:
    spec: RunSpec
    runs: dict  # Combo -> CompareRun, in subsets() order
    manifest: dict = field(default_factory=dict)

    @property
    def regions(self) -> tuple[str, ...]:
        """What the attribution splits the change among: the regions, then the factors (AblateSpec.players)."""
        return self.spec.ablate.players

    def _named(self) -> list[tuple[str, CompareRun]]:
        return [(combo_name(c, self.regions), run) for c, run in self.runs.items()]

    def _stacked(self, table: str) -> pd.DataFrame:
        return pd.concat([getattr(run, table).assign(combo=name) for name, run in self._named()], ignore_index=True)[
            ["combo", *getattr(next(iter(self.runs.values())), table).columns]]

    @property
    def prompts(self):
        return next(iter(self.runs.values())).prompts

    @property
    def tokens_table(self) -> pd.DataFrame:
        return self._stacked("tokens_table")

    @property
    def layers_table(self) -> pd.DataFrame:
        return self._stacked("layers_table")

    @property
    def summary_table(self) -> pd.DataFrame:
        return pd.DataFrame([{"combo": name, **run.summary} for name, run in self._named()])

    @property
    def ablation_table(self) -> pd.DataFrame:
        rows = []
        for combo, run in self.runs.items():
            rows.append({"combo": combo_name(combo, self.regions), **{r: r in combo for r in self.regions},
                         **run.summary})
        return pd.DataFrame(rows)

    def metric_of(self, metric: str | None = None) -> dict:
        """The combinations' values of `metric` (default: the run's --metric)."""
        fn = METRICS[metric or self.spec.ablate.metric]
        return {c: fn(p, [1] * len(p)) for c, p in self._per_prompt().items()}

    def _per_prompt(self) -> dict:
        return {c: per_prompt(run.tokens_table) for c, run in self.runs.items()}

    @cached_property
    def attribution_table(self) -> pd.DataFrame:  # cached: its bootstrap is the slow part of writing a run
        options = self.spec.ablate
        table = attribution(self.metric_of(), self.regions)
        if options.bootstrap:
            ci = bootstrap_intervals(self._per_prompt(), self.regions, options.metric, options.bootstrap,
                                     self.spec.load.seed, options.ci_level)
            for suffix, key in (("", ""), ("share_", "/share")):
                table[suffix + "ci_low"] = [ci[r + key][0] for r in table["region"]]
                table[suffix + "ci_high"] = [ci[r + key][1] for r in table["region"]]
        else:
            table["ci_low"] = table["ci_high"] = table["share_ci_low"] = table["share_ci_high"] = float("nan")
        table[EFFECT] = [effect(lo, hi) for lo, hi in zip(table["ci_low"], table["ci_high"])]
        other = OTHER_METRIC[options.metric]
        table["other_metric"] = other
        table["other_metric_share"] = attribution(self.metric_of(other), self.regions)[SHARE].to_numpy()
        table[DISAGREE] = [disagree(a, b) for a, b in zip(table[SHARE], table["other_metric_share"])]
        return table

    def files(self) -> dict[str, pd.DataFrame]:
        tables = {"tokens.csv": self.tokens_table, "layers.csv": self.layers_table, "summary.csv": self.summary_table,
                  "ablation.csv": self.ablation_table, "attribution.csv": self.attribution_table}
        first = next(iter(self.runs.values()))
        if first.mode == "generate":
            tables["buckets.csv"] = self._stacked("buckets_table")
        if first.batch_invariance is not None:
            tables["batch_invariance.csv"] = self._stacked("batch_invariance")
        if first.kernel_noise is not None:
            tables["kernel_noise.csv"] = self._stacked("kernel_noise")
        for name in first.graft_tables:  # --graft/--depth: each combination's local error beside the shipped one
            tables[name] = pd.concat([run.graft_tables[name].assign(combo=combo) for combo, run in self._named()],
                                     ignore_index=True)[["combo", *first.graft_tables[name].columns]]
        if first.engine_noise is not None:
            tables["engine_noise.csv"] = self._stacked("engine_noise")
        if first.routing is not None:
            tables["routing.csv"] = self._stacked("routing_table")
        if first.routing_noise is not None:
            tables["routing_noise.csv"] = self._stacked("routing_noise")
        if first.reference is not None and first.reference.local is not None:  # --reference's local reading
            tables["reference_local.csv"] = self._stacked("reference_local_table")
        return tables

    def write(self, out_dir: str | Path) -> Path:
        from ..rundir import write_run

        shipped = next(iter(self.runs.values())).summary  # the stacks as shipped: combination `none`
        return write_run(Path(out_dir), self.manifest | manifest_record(shipped), self.prompts, self.files())


def combo_spec(spec: RunSpec, combo) -> RunSpec:
    """The compare that one combination of an ablation runs."""
    return spec.combination(combo)


def run_ablation(probe, spec: RunSpec, progress: Progress | None = None) -> AblationRun:
    players = spec.ablate.players
    combos = subsets(players)
    side = spec.align.side
    runs: dict = {}
    done_before = 0
    # A compiled engine is rebuilt per combination in a worker process (and an engine factor's engine is built there);
    # the next combinations' engines start building while this one runs: one ahead on the CPU; on a GPU none unless
    # asked (each engine reserves its share of the GPU).
    ahead = spec.ablate.build_ahead
    if ahead is None:
        ahead = 1 if probe.settings.device == "cpu" else 0
    steps = [spec.combination(combo) for combo in combos]
    builds = [needs_worker(probe, step, side) for step in steps]
    started: dict[int, object] = {}

    def start(i: int) -> None:
        if i < len(steps) and builds[i] and i not in started:
            started[i] = start_worker(probe, steps[i])

    noise_engines = NoiseEngines(probe.config.infer)  # --engine-noise: one eager engine serves every combination
    arm = ExitStack()  # --reference: one reference stack serves every combination
    try:
        reference = arm.enter_context(reference_arm(probe, spec.capture.reference))
        for i, (combo, step) in enumerate(zip(combos, steps)):
            for j in range(i, i + 1 + ahead):
                start(j)
            phase(progress, f"combination {combo_name(combo, players)} ({i + 1}/{len(combos)})",
                  offset=done_before, scale=len(combos))
            with configured(probe, step, started.pop(i, None)) as view:
                runs[combo] = run_compare(view, step, progress, done_before=done_before, total_scale=len(combos),
                                          noise_engines=noise_engines, reference=reference)
            done_before += len(runs[combo].prompts)
    finally:
        arm.close()
        noise_engines.close()
        for worker in started.values():
            worker.close()
    return ablation(spec, runs)


def run_ablation_kept(probe, spec: RunSpec, engine_for, progress: Progress | None = None) -> AblationRun:
    """--placement alternate's trainer pass (runs/alternate.py): each combination on the trainer alone, against its
    engine pass's outputs (`engine_for(step)`: the kept engine and --engine-noise's kept other engines), with its
    trainer factors and its regions aligned in the trainer (the engine pass had its own)."""
    players = spec.ablate.players
    combos = subsets(players)
    runs, done_before = {}, 0
    for i, combo in enumerate(combos):
        step = spec.combination(combo)
        phase(progress, f"combination {combo_name(combo, players)} ({i + 1}/{len(combos)})",
              offset=done_before, scale=len(combos))
        engine, noise = engine_for(step)
        with ExitStack() as stack:
            view = replace(trainer_configured(probe, step, stack), infer=engine, owns_infer=False,
                           settings=engine_settings_for(probe.config, probe.settings, step.load))
            stack.enter_context(aligned([view.train] if step.align.side != "infer" else [], step.align.regions))
            runs[combo] = run_compare(view, step, progress, done_before=done_before, total_scale=len(combos),
                                      noise_engines=noise)
        done_before += len(runs[combo].prompts)
    return ablation(spec, runs)


def ablation(spec: RunSpec, runs: dict) -> AblationRun:
    """The ablation of its combinations' runs: the manifest of the shipped one, with what accumulates over all."""
    players = spec.ablate.players
    combos = list(runs)
    # The shipped combination's manifest says what each region ran as; what accumulates over the combinations (the
    # reduction's compile state, the largest captured-logits gap) is taken from all of them.
    manifests = [run.manifest for run in runs.values()]
    shipped = copy.deepcopy(manifests[0])
    shipped.pop("align", None)
    shipped["compare"]["tap_reduction"] = manifests[-1]["compare"]["tap_reduction"]
    infer = shipped["stacks"]["infer"]["settings"]
    if GAP in infer:
        infer[GAP] = max(m["stacks"]["infer"]["settings"][GAP] for m in manifests)
    a = spec.ablate
    section = {"regions": list(a.regions), "side": spec.align.side, "metric": a.metric, "bootstrap": a.bootstrap,
               "ci_level": a.ci_level, "seed": spec.load.seed, "combos": [combo_name(c, players) for c in combos]}
    if a.factors:
        section["factors"] = {label: next(run.manifest["load"] for c, run in runs.items() if c == frozenset({label}))
                              for label in a.factors}
    rebuilt = {combo_name(c, players): run.manifest["stacks"]["infer"]["settings"].get("engine_process")
               for c, run in runs.items()}
    if any(rebuilt.values()):  # a compiled engine built per combination: how each build ran its regions
        section["engine_builds"] = {name: build for name, build in rebuilt.items() if build}
    return AblationRun(spec, runs, build_manifest("ablate", shipped, {"ablate": section}, spec=spec.to_dict()))
