"""`diff RUN_A RUN_B`: what moved between two runs of the same prompts and model, e.g. before and after an engine,
kernel or trainer upgrade, or with and without a region aligned.

Both folders are read as untrusted input (load.py, run_folder.read_run: hashes checked, columns checked). Two
runs are comparable only on the same prompts (prompt file hashes, or the rollout file's, and the prompts' token ids)
and the same model (its config.json hash); anything else is refused in one line. Of an ablation, the shipped
combination is compared. Written, all or nothing:

- diff_summary.csv: every summary metric of A and B side by side, with their difference and ratio, both runs'
  noise floors among them and the mismatch over the largest floor (gate.MISMATCH_OVER_FLOOR);
- diff_layers.csv: rel_l2 per (layer, tap) of A and B, the ratio, and whether the error grew;
- diff_tokens.csv (.gz past GZIP_ROWS rows): per scored token, |Δlogp| in A and in B, most moved first;
- diff_routing.csv (mixture of experts): the cross-stack routing flip rate per layer in A and B;
- diff_manifest.csv: every manifest entry that differs (versions, engine args, trainer settings, regions, ...);
- diff.md: the same, for a reader.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import ProbeError
from .gate import MISMATCH_OVER_FLOOR, measured
from ..rundir import output_folder, write_csv
from ..numerics.shapley import SHIPPED
from ..numerics.tables import NOISE_FLOORS
from .load import load_run
from .run_data import RunData, layers_of, shipped_rows

DIFF = "diff"  # the output kind its folder is marked as (rundir.mark)
GZIP_ROWS = 200_000
# manifest entries that differ between any two runs and say nothing about what changed in the numerics (the free
# memory at start, where the files lay, the verdict of a gate)
IGNORED = ("command", "files", "compare.prompts", "score.rollouts", "score.spec.rollouts", "gate", "memory_plan.free")
TOP = 10  # rows of each table in the printed and the markdown summary


@dataclass
class RunDiff:
    a: Path
    b: Path
    summary: pd.DataFrame
    layers: pd.DataFrame
    tokens: pd.DataFrame
    routing: pd.DataFrame | None
    manifest: pd.DataFrame

    def files(self) -> dict[str, pd.DataFrame]:
        tables = {"diff_summary.csv": self.summary, "diff_layers.csv": self.layers,
                  ("diff_tokens.csv.gz" if len(self.tokens) > GZIP_ROWS else "diff_tokens.csv"): self.tokens,
                  "diff_manifest.csv": self.manifest}
        if self.routing is not None:
            tables["diff_routing.csv"] = self.routing
        return tables

    def write(self, out_dir: str | Path) -> Path:
        out_dir = Path(out_dir)
        with output_folder(out_dir, DIFF) as tmp:
            for name, frame in self.files().items():
                write_csv(frame, tmp / name)
            (tmp / "diff.md").write_text(self.markdown(), encoding="utf-8")
        return out_dir

    def markdown(self) -> str:
        lines = [f"# What moved: {self.a} → {self.b}", "",
                 "A is the first run, B the second; Δ = B − A, ratio = B / A.", "", "## Summary", "",
                 _md(self.summary), "", "## Layers whose error grew most (diff_layers.csv)", "",
                 _md(self.layers[self.layers["grew"]].sort_values("ratio", ascending=False).head(TOP)), "",
                 "## Tokens whose |Δlogp| moved most (diff_tokens.csv)", "", _md(self.tokens.head(TOP)), ""]
        if self.routing is not None:
            lines += ["## Routing per layer (diff_routing.csv)", "", _md(self.routing), ""]
        lines += ["## Settings that differ (diff_manifest.csv)", "",
                  _md(self.manifest) if len(self.manifest) else "none: the manifests agree on every setting", ""]
        return "\n".join(lines)


def _md(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "none"
    cells = frame.map(lambda v: f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|"))
    rows = [list(frame.columns), ["---"] * len(frame.columns), *cells.values.tolist()]
    return "\n".join("| " + " | ".join(map(str, r)) + " |" for r in rows)


def diff_runs(a: str | Path, b: str | Path) -> RunDiff:
    """Read two run folders and diff them; ProbeError (one line) when they are not runs of the same prompts and
    model."""
    run_a, run_b = load_run(a), load_run(b)
    same_inputs(run_a, run_b)
    return RunDiff(run_a.path, run_b.path, summary_diff(run_a, run_b), layers_diff(run_a, run_b),
                   tokens_diff(run_a, run_b), routing_diff(run_a, run_b), manifest_diff(run_a, run_b))


# ---------------------------------------------------------------------------------------------- comparable?
def same_inputs(a: RunData, b: RunData) -> None:
    """Refuse runs of other prompts or another model: their numbers do not compare."""
    model = [(r.manifest.get("model") or {}).get("config_sha256") for r in (a, b)]
    if not all(isinstance(m, str) for m in model):
        lacking = a.path if not isinstance(model[0], str) else b.path
        raise ProbeError(f"{lacking}/manifest.json records no model hash (model.config_sha256), so the two runs "
                         "cannot be shown to share a model; diff runs made with --model")
    if model[0] != model[1]:
        raise ProbeError(f"{a.path} and {b.path} ran different models (config.json sha256 {model[0][:12]}… vs "
                         f"{model[1][:12]}…); diff two runs of one checkpoint")
    inputs = [_inputs(r) for r in (a, b)]
    if inputs[0] != inputs[1]:
        raise ProbeError(f"{a.path} and {b.path} scored different prompts (their prompt or rollout file hashes "
                         "differ); diff two runs of the same --prompts")
    ids = [[tuple(p.get("token_ids", ())) for p in r.prompts] if r.prompts is not None else None for r in (a, b)]
    if ids[0] != ids[1]:
        raise ProbeError(f"{a.path} and {b.path} scored different prompt token ids (another tokenization, "
                         "--num-prompts or --max-prompt-tokens); diff two runs of the same prompts")


def _inputs(run: RunData):
    if run.is_score:
        return ("rollouts", (run.manifest.get("score") or {}).get("rollouts_sha256"))
    compared = run.manifest.get("compare") or {}
    return ("prompts", json.dumps(compared.get("prompt_files_sha256"), sort_keys=True))


# ---------------------------------------------------------------------------------------------- tables
def _summary(run: RunData) -> dict:
    return shipped_rows(run.summary).iloc[0].to_dict()


def summary_diff(a: RunData, b: RunData) -> pd.DataFrame:
    """Every metric either summary holds (A's order, then B's new ones), the floors among them, and
    mismatch_over_floor of each."""
    sa, sb = _summary(a), _summary(b)
    names = [n for n in dict.fromkeys([*sa, *sb]) if n != "combo"]
    rows = []
    for name in [*names, MISMATCH_OVER_FLOOR]:
        va, vb = measured(sa, name), measured(sb, name)
        if va is None and vb is None:
            continue
        row = {"metric": name, "a": va, "b": vb, "delta": math.nan, "ratio": math.nan,
               "noise_floor": name in NOISE_FLOORS}
        if _number(va) and _number(vb):
            row["delta"] = float(vb) - float(va)
            row["ratio"] = float(vb) / float(va) if float(va) else math.nan
        rows.append(row)
    return pd.DataFrame(rows, columns=["metric", "a", "b", "delta", "ratio", "noise_floor"])


def _number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def layers_diff(a: RunData, b: RunData) -> pd.DataFrame:
    """rel_l2 per (layer, tap) in both runs; grew: B's error is larger."""
    la, lb = (layers_of(r, SHIPPED)[["layer", "tap", "rel_l2"]] for r in (a, b))
    merged = la.merge(lb, on=["layer", "tap"], how="outer", suffixes=("_a", "_b"), sort=False)
    merged["ratio"] = merged["rel_l2_b"] / merged["rel_l2_a"].where(merged["rel_l2_a"] > 0)
    merged["grew"] = merged["rel_l2_b"] > merged["rel_l2_a"]
    return merged.reset_index(drop=True)


def tokens_diff(a: RunData, b: RunData) -> pd.DataFrame:
    """Per token both runs scored (the same token at the same place), |Δlogp| in each; most moved first. Of a
    generate run, only tokens both runs sampled identically line up."""
    if a.tokens is None or b.tokens is None:
        return pd.DataFrame(columns=["prompt_id", "position", "token_id", "abs_dlogp_a", "abs_dlogp_b", "moved"])
    keys = [k for k in ("prompt_id", "sample_id", "position", "token_id") if k in a.tokens and k in b.tokens]
    ta, tb = (shipped_rows(r.tokens) for r in (a, b))
    ta = ta[keys].assign(abs_dlogp_a=ta["delta_logprob"].abs())
    tb = tb[keys].assign(abs_dlogp_b=tb["delta_logprob"].abs())
    merged = ta.merge(tb, on=keys, how="inner")
    merged["moved"] = merged["abs_dlogp_b"] - merged["abs_dlogp_a"]
    order = merged["moved"].abs().sort_values(ascending=False, kind="stable").index
    return merged.loc[order].reset_index(drop=True)


def routing_diff(a: RunData, b: RunData) -> pd.DataFrame | None:
    """A mixture of experts: the share of tokens routed to another top-k set, per layer, in each run."""
    ra, rb = (r.extra.get("routing") for r in (a, b))
    if ra is None or rb is None:
        return None
    ra, rb = (shipped_rows(r)[["layer", "frac_topk_set_differs"]] for r in (ra, rb))
    merged = ra.merge(rb, on="layer", how="outer", suffixes=("_a", "_b"))
    merged["delta"] = merged["frac_topk_set_differs_b"] - merged["frac_topk_set_differs_a"]
    return merged


def manifest_diff(a: RunData, b: RunData) -> pd.DataFrame:
    """Every manifest entry (flattened: stacks.infer.versions.vllm) whose value differs, IGNORED aside."""
    fa, fb = _flat(a.manifest), _flat(b.manifest)
    rows = [{"key": k, "a": fa.get(k, ""), "b": fb.get(k, "")} for k in dict.fromkeys([*fa, *fb])
            if fa.get(k) != fb.get(k) and not any(k == i or k.startswith(i + ".") for i in IGNORED)]
    return pd.DataFrame(rows, columns=["key", "a", "b"])


def _flat(obj, prefix: str = "") -> dict[str, str]:
    if isinstance(obj, dict):
        out: dict[str, str] = {}
        for key, value in obj.items():
            out |= _flat(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: json.dumps(obj, sort_keys=True, default=str)}
