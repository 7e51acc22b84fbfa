"""A run folder read for the report (load_run, via run_folder.read_run): its tables into a RunData (run_data.py), the
manifest's numbers checked as their flags are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..run_folder import read_run
from ..rundir import MANIFEST, RERUN, RunFolderError
from ..numerics.shapley import ALL_REGIONS, CHANGE, SHARE, SHIPPED
from .run_data import RunData, row_of

ReportError = RunFolderError  # what `report` raises for a run folder it cannot use (and a bad --format)
DEFAULT_CLIP_EPS = 0.2
DEFAULT_CI_LEVEL = 0.95  # ablate's bootstrap interval before the manifest recorded its level


def _recorded(manifest: dict, section: str, name: str, default):
    """A number the report reads from the manifest, checked as its flag is (spec.recorded_value: the spec class's
    own checks), or `default` for a run recorded without it."""
    value = manifest.get(section, {}).get(name)
    if value is None:
        return default
    from ..spec.align import AblateSpec
    from ..spec.generate import GenerateSpec
    from ..spec.from_manifest import recorded_value
    from ..spec.remedies import RemediesSpec

    return recorded_value({"ablate": AblateSpec, "remedies": RemediesSpec}.get(section, GenerateSpec), name, value,
                          f"{section}.{name}")


def _as_bool(series: pd.Series) -> pd.Series:
    if series.dtype == bool:
        return series
    return series.astype(str).str.strip().str.lower().isin(("true", "1", "yes"))


# The manifest sections the report reads into, and the objects inside `stacks.<side>`: each must be a JSON object
# when present (an edited manifest with `"model": 5` is refused here, not met as a traceback while writing prose).
SECTIONS = ("model", "load", "environment", "stacks", "compare", "ablate", "files", "score", "generate", "remedies")
STACK_SECTIONS = ("settings", "implementations", "versions")


def _check_sections(path: Path, manifest: dict) -> None:
    found = [(key, manifest.get(key)) for key in SECTIONS]
    stacks = manifest.get("stacks")
    if isinstance(stacks, dict):
        for side in ("infer", "train"):
            found.append((f"stacks.{side}", stacks.get(side)))
            if isinstance(stacks.get(side), dict):
                found += [(f"stacks.{side}.{k}", stacks[side].get(k)) for k in STACK_SECTIONS]
    for key, value in found:
        if value is not None and not isinstance(value, dict):
            raise ReportError(f"{path / MANIFEST} has `{key}` = {str(value)[:40]!r}, not an object: it was edited or "
                              f"damaged; restore it or {RERUN}")


LEGACY_REMAINING = "(remaining)"  # attribution.csv's last row before it held the all-regions change


def _from_reductions(old: pd.DataFrame, run: RunData) -> pd.DataFrame:
    """An attribution.csv written before the signed changes (`shapley` = the reduction a region makes, `share` = of
    the total reduction, a last `(remaining)` row holding the metric left) in today's columns: every value negated
    into a change, shares of the shipped metric. The share intervals are the change intervals over the shipped
    point value; the all-regions row, not recorded then, is the difference of the two combinations, no interval."""
    if "shapley" not in old:
        raise ReportError(f"{run.path / 'attribution.csv'} has neither {CHANGE!r} nor 'shapley'; rerun the ablation")
    shipped = float(row_of(run.ablation, SHIPPED)[run.metric])
    regions = old[old["region"] != LEGACY_REMAINING]

    def negated(column: str) -> np.ndarray:
        return -regions[column].to_numpy(np.float64) if column in regions else np.full(len(regions), np.nan)

    table = pd.DataFrame({"region": regions["region"].to_numpy(), CHANGE: negated("shapley"),
                          "main_effect_change": negated("main_effect"),
                          "leave_one_out_change": negated("leave_one_out"),
                          "ci_low": negated("ci_high"), "ci_high": negated("ci_low")})
    if run.all_aligned:
        change = float(row_of(run.ablation, run.all_aligned)[run.metric]) - shipped
        table = pd.concat([table, pd.DataFrame([{"region": ALL_REGIONS, CHANGE: change}])], ignore_index=True)
    for column, source in ((SHARE, CHANGE), ("share_ci_low", "ci_low"), ("share_ci_high", "ci_high")):
        table[column] = table[source] / shipped if shipped else np.nan
    return table


def load_run(run_dir: str | Path) -> RunData:
    """Read a run folder; ReportError when it is missing, is not one, or has a cut or changed file."""
    # The token strings are not needed and can be anything; they are not read.
    folder = read_run(run_dir, drop=("token",))
    path, tables = folder.path, folder.tables
    _check_sections(path, folder.manifest)
    summary = tables["summary.csv"]
    if summary.empty:
        raise ReportError(f"{path / 'summary.csv'} has no rows; rerun the command that made the run folder")
    layers = tables.get("layers.csv", pd.DataFrame(columns=["layer", "tap", "rel_l2"]))
    manifest = folder.manifest  # its numbers are checked here, before anything is drawn or written
    clip_section = "score" if manifest.get("kind") == "score" else "generate"  # RunData.is_score
    level_section = "remedies" if manifest.get("kind") == "remedies" else "ablate"  # the runs that draw intervals
    run = RunData(path=path, manifest=manifest, summary=summary, layers=layers,
                  clip_eps=_recorded(manifest, clip_section, "clip_eps", DEFAULT_CLIP_EPS),
                  ci_level=f"{100 * _recorded(manifest, level_section, 'ci_level', DEFAULT_CI_LEVEL):g}%")

    if "ablation.csv" in tables:
        run.ablation = tables["ablation.csv"]
        for region in run.regions:
            run.ablation[region] = _as_bool(run.ablation[region])
        if run.metric not in run.ablation.columns:
            raise ReportError(f"{path / 'ablation.csv'} has no column {run.metric!r} (the manifest's ablate "
                              "metric); rerun the ablation")
    if "attribution.csv" in tables:
        attribution = tables["attribution.csv"]
        if CHANGE not in attribution:
            attribution = _from_reductions(attribution, run)
        for col in ("main_effect_change", "leave_one_out_change", "ci_low", "ci_high", "share_ci_low", "share_ci_high"):
            if col not in attribution:
                attribution[col] = np.nan
        run.attribution = attribution

    run.tokens_file = folder.file_of("tokens.csv")
    if run.tokens_file is not None:
        run.tokens = tables[run.tokens_file]
        if "is_response" in run.tokens:
            run.tokens["is_response"] = _as_bool(run.tokens["is_response"])
        if run.is_score:  # the recorded logprobs play the inference side in every figure and ratio
            run.tokens = run.tokens.rename(columns={"logprob_rollout": "logprob_infer"})

    for stem in ("buckets", "batch_invariance", "kernel_noise", "engine_noise", "local", "local_families", "depth",
                 "routing", "routing_noise", "local_routing", "remedies"):
        if f"{stem}.csv" in tables:
            run.extra[stem] = tables[f"{stem}.csv"]

    if folder.prompts is not None:
        run.prompts = folder.prompts
        run.n_prompts = len(folder.prompts)
        run.n_truncated = sum(bool(r.get("truncated")) for r in folder.prompts)
    elif run.tokens is not None:
        run.n_prompts = int(run.tokens["prompt_id"].nunique())
    return run
