"""The rl run's report: reward and mismatch against step, one line per setting, seeds as a band (min to max).

    from divergence_probe.reports.rl import write_rl_report
    write_rl_report("runs/rl")          # runs/rl/report/report.md + figures/rl.png|pdf

rl.csv is checked against the sha256 the manifest recorded before anything is drawn (a run that did not finish
has no manifest: its rows are plotted with `check=False`, as the rl command does for a stopped run).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from ..rundir import MANIFEST, atomic_dir, locked
from . import figures as F
from .load import ReportError

PANELS = (("reward_mean", "mean reward"), ("mean_abs_dlogp", "mean |Δlogp| (trainer − engine)"))


@F._styled
def rl_curves(rows: pd.DataFrame) -> Figure:
    """Two panels (reward, mismatch) against step; per setting the mean over seeds, and the seeds' range as a band."""
    fig, axes = F._new_figure(ncols=len(PANELS))
    for ax, (column, label) in zip(axes, PANELS):
        for i, (setting, part) in enumerate(rows.groupby("setting", sort=False)):
            by_step = part.groupby("step")[column]
            mean, lo, hi = by_step.mean(), by_step.min(), by_step.max()
            s = F.style(i)
            ax.plot(mean.index, mean.values, color=s["color"], linestyle=s["linestyle"],
                    marker=s["marker"] if len(mean) <= 30 else None, markersize=4,
                    label=f"{setting} ({part.seed.nunique()} seed{'s' if part.seed.nunique() > 1 else ''})")
            if part.seed.nunique() > 1:
                ax.fill_between(mean.index, lo.values, hi.values, color=s["color"], alpha=0.15, hatch=F.HATCHES[i],
                                linewidth=0)
        ax.set_xlabel("step")
        ax.set_title(label)
        if column == "mean_abs_dlogp":
            ax.set_yscale("log")
    axes[0].legend(loc="best")
    return fig


def read_rows(run_dir: Path, check: bool = True) -> pd.DataFrame:
    path = Path(run_dir) / "rl.csv"
    if not path.is_file():
        raise ReportError(f"{run_dir} has no rl.csv; pass the --out folder of an rl run")
    if check:
        manifest_path = Path(run_dir) / MANIFEST
        if not manifest_path.is_file():
            raise ReportError(f"{run_dir} has no manifest.json: the rl run did not finish; its rows are in rl.csv")
        record = json.loads(manifest_path.read_text()).get("files", {}).get("rl.csv", {})
        if hashlib.sha256(path.read_bytes()).hexdigest() != record.get("sha256"):
            raise ReportError(f"{path} is not the file the run wrote (its sha256 differs from the manifest's); "
                              "rerun the rl command")
    return pd.read_csv(path)


def _markdown(table: pd.DataFrame) -> str:
    cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    head = "| " + " | ".join(table.columns) + " |\n|" + "---|" * len(table.columns)
    return head + "".join("\n| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False))


def write_rl_report(run_dir: str | Path, out_dir: str | Path | None = None, check: bool = True,
                    fmt: str = "md") -> Path:
    """report.md with rl_summary.csv as a table and figures/rl.png|pdf, into out_dir (default run_dir/report)."""
    if fmt != "md":
        raise ReportError(f"--format {fmt}: an rl run's report is markdown (report.md + PNG/PDF figures); drop --format")
    run_dir = Path(run_dir)
    rows = read_rows(run_dir, check)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    summary_path = run_dir / "rl_summary.csv"
    with locked(out_dir), atomic_dir(out_dir, replace=lambda p: (p / "report.md").is_file()) as tmp:
        F.save(rl_curves(rows), tmp / "figures", "rl")
        lines = ["# divergence-probe rl", "",
                 f"{rows.setting.nunique()} setting(s) x {rows.seed.nunique()} seed(s), {rows.step.max()} steps.", "",
                 "![reward and mismatch against step](figures/rl.png)", ""]
        if summary_path.is_file():
            lines += [_markdown(pd.read_csv(summary_path)), ""]
        (tmp / "report.md").write_text("\n".join(lines), encoding="utf-8")
    return out_dir / "report.md"
