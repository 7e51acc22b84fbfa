"""ablate: rerun compare with every subset of regions aligned and attribute the mismatch to regions.

Each model is loaded once; between runs only the region patches are toggled (they are reversible and
never touch weights). Prompts, taps and every other option are the same in every run, so the runs
differ in the aligned regions alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from .shapley import METRICS, REMAINING, attribution, bootstrap_intervals, combo_name, per_prompt, subsets
from .compare import CompareOptions, CompareRun
from .errors import ProbeError
from .regions import aligned, parse_regions

SIDES = ("both", "train", "infer")


@dataclass(frozen=True, kw_only=True)
class AblateOptions:
    regions: str | tuple[str, ...] = ("rope", "swiglu", "rmsnorm")
    """Regions to ablate; every subset of them is run (2^k runs)."""
    side: str = "both"
    """both: patch both stacks; train: only transformers (the engine as shipped); infer: only the engine."""
    metric: str = "mean_kl"
    """What attribution explains: mean_kl, mean_abs_dlogp, max_kl or max_abs_dlogp."""
    bootstrap: int = 1000
    """Bootstrap resamples of prompts for the confidence intervals (0 = no intervals)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise ProbeError(f"--side {self.side!r}; choose one of: {', '.join(SIDES)}")
        if self.metric not in METRICS:
            raise ProbeError(f"--metric {self.metric!r}; choose one of: {', '.join(METRICS)}")
        if self.bootstrap < 0:
            raise ProbeError("--bootstrap must be >= 0")
        if not parse_regions(self.regions):
            raise ProbeError("--regions is empty; name at least one region")


def stacks_for(probe, side: str) -> list:
    return {"both": [probe.infer, probe.train], "train": [probe.train], "infer": [probe.infer]}[side]


@dataclass
class AblationRun:
    regions: tuple[str, ...]
    options: AblateOptions
    runs: dict  # Combo -> CompareRun, in subsets() order
    manifest: dict = field(default_factory=dict)

    def _named(self):
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
        fn = METRICS[self.options.metric]
        return {c: fn(p, [1] * len(p)) for c, p in self._per_prompt().items()}

    def _per_prompt(self) -> dict:
        return {c: per_prompt(run.tokens_table) for c, run in self.runs.items()}

    @property
    def attribution_table(self) -> pd.DataFrame:
        metric_of = self.metric_of()
        table = attribution(metric_of, self.regions)
        everything, nothing = frozenset(self.regions), frozenset()
        remaining = {"region": REMAINING, "shapley": metric_of[everything],
                     "share": metric_of[everything] / metric_of[nothing] if metric_of[nothing] else float("nan"),
                     "main_effect": float("nan"), "leave_one_out": float("nan")}
        table = pd.concat([table, pd.DataFrame([remaining])], ignore_index=True)
        if self.options.bootstrap:
            ci = bootstrap_intervals(self._per_prompt(), self.regions, self.options.metric,
                                     self.options.bootstrap, self.options.seed)
            table["ci_low"] = [ci[r if r != REMAINING else "remaining"][0] for r in table["region"]]
            table["ci_high"] = [ci[r if r != REMAINING else "remaining"][1] for r in table["region"]]
        else:
            table["ci_low"] = table["ci_high"] = float("nan")
        return table

    def write(self, out_dir: str | Path) -> Path:
        from .rundir import write_ablation_run

        return write_ablation_run(self, Path(out_dir))


def run_ablation(probe, run_one, compare: CompareOptions, options: AblateOptions) -> AblationRun:
    """run_one(probe, compare_options) is one compare or generate-mode run; it is repeated per combination."""
    regions = parse_regions(options.regions)
    combos = subsets(regions)
    stacks = stacks_for(probe, options.side)
    runs: dict = {}
    done_before = 0
    for combo in combos:
        progress = compare.progress
        step = replace(compare, progress=(lambda d, t, base=done_before: progress(base + d, t * len(combos)))
                       if progress else None)
        with aligned(stacks, [r for r in regions if r in combo]):
            runs[combo] = run_one(probe, step)
        done_before += len(runs[combo].prompts)
    manifest = dict(next(iter(runs.values())).manifest)
    manifest["ablate"] = {"regions": list(regions), "side": options.side, "metric": options.metric,
                          "bootstrap": options.bootstrap, "seed": options.seed,
                          "combos": [combo_name(c, regions) for c in combos]}
    return AblationRun(regions, options, runs, manifest)


def run_aligned_compare(probe, run_one, compare: CompareOptions, regions, side: str) -> CompareRun:
    """compare --align: one run with the given regions aligned on the given side(s) (none: as shipped)."""
    names = parse_regions(regions)
    AblateOptions(regions=names or ("rope",), side=side)  # validates side
    with aligned(stacks_for(probe, side), names):
        run = run_one(probe, compare)
    if names:
        run.manifest["align"] = {"regions": list(names), "side": side}
    return run
