"""ablate: rerun compare with every subset of regions aligned and attribute the mismatch to regions.

Each model is loaded once; between runs only the region patches are toggled (they are reversible and never
touch weights). Prompts, taps and every other option are the same in every run, so the runs differ in the
aligned regions alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import pandas as pd

from .batch_invariance import NoiseEngines
from .compare import CompareRun, run_compare
from .manifest import build_manifest
from .progress import Progress, phase
from .engine_align import aligned_probe, engine_worker, needs_engine_build, stacks_for  # noqa: F401 (stacks_for: API)
from ..numerics.noise_verdict import manifest_record
from ..numerics.shapley import METRICS, attribution, bootstrap_intervals, combo_name, per_prompt, subsets
from ..spec.run import RunSpec


GAP = "captured_logits_vs_reported_logprobs_max_gap"  # the inference stack's logits check, per run


@dataclass
class AblationRun:
    spec: RunSpec
    runs: dict  # Combo -> CompareRun, in subsets() order
    manifest: dict = field(default_factory=dict)

    @property
    def regions(self) -> tuple[str, ...]:
        return self.spec.ablate.regions

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

    def metric_of(self) -> dict:
        fn = METRICS[self.spec.ablate.metric]
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
        return tables

    def write(self, out_dir: str | Path) -> Path:
        from ..rundir import write_run

        shipped = next(iter(self.runs.values())).summary  # the stacks as shipped: combination `none`
        return write_run(Path(out_dir), self.manifest | manifest_record(shipped), self.prompts, self.files())


def combo_spec(spec: RunSpec, combo) -> RunSpec:
    """The compare that one combination of an ablation runs."""
    regions = tuple(r for r in spec.ablate.regions if r in combo)
    replay = spec.align.routing_replay if "routing" in regions else "ids"  # only a combination with routing replays
    return replace(spec, kind="compare", ablate=None, align=replace(spec.align, regions=regions, routing_replay=replay))


def run_ablation(probe, spec: RunSpec, progress: Progress | None = None) -> AblationRun:
    combos = subsets(spec.ablate.regions)
    side = spec.align.side
    runs: dict = {}
    done_before = 0
    # A compiled engine is rebuilt per combination in a worker process; the next combinations' engines start building
    # while this one runs: one ahead on the CPU; on a GPU none unless asked (each engine reserves its share of the GPU).
    ahead = spec.ablate.build_ahead
    if ahead is None:
        ahead = 1 if probe.settings.device == "cpu" else 0
    steps = [combo_spec(spec, combo) for combo in combos]
    builds = [needs_engine_build(probe, step.align.regions, side) for step in steps]
    started: dict[int, object] = {}

    def start(i: int) -> None:
        if i < len(steps) and builds[i] and i not in started:
            started[i] = engine_worker(probe, steps[i].align.regions)

    noise_engines = NoiseEngines()  # --engine-noise: one eager engine serves every combination
    try:
        for i, (combo, step) in enumerate(zip(combos, steps)):
            for j in range(i, i + 1 + ahead):
                start(j)
            phase(progress, f"combination {combo_name(combo, spec.ablate.regions)} ({i + 1}/{len(combos)})",
                  offset=done_before, scale=len(combos))
            with aligned_probe(probe, step.align.regions, side, started.pop(i, None)) as view:
                runs[combo] = run_compare(view, step, progress, done_before=done_before, total_scale=len(combos),
                                          noise_engines=noise_engines)
            done_before += len(runs[combo].prompts)
    finally:
        noise_engines.close()
        for worker in started.values():
            worker.close()
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
               "ci_level": a.ci_level, "seed": spec.load.seed, "combos": [combo_name(c, a.regions) for c in combos]}
    rebuilt = {combo_name(c, a.regions): run.manifest["stacks"]["infer"]["settings"].get("engine_process")
               for c, run in runs.items()}
    if any(rebuilt.values()):  # a compiled engine built per combination: how each build ran its regions
        section["engine_builds"] = {name: build for name, build in rebuilt.items() if build}
    return AblationRun(spec, runs, build_manifest("ablate", shipped, {"ablate": section}, spec=spec.to_dict()))
