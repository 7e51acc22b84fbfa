"""The rl run's report: reward and mismatch against step, one line per setting, seeds as a band (min to max).

    from divergence_probe.reports.rl import write_rl_report
    write_rl_report("runs/rl")          # runs/rl/report/report.md + figures/rl.png|pdf

rl.csv and rl_summary.csv are checked against the sha256 the manifest recorded before anything is drawn (a run that
did not finish has no manifest: its rows are plotted with `check=False`, as the rl command does for a stopped run),
and must have the columns the figure and the table read, as numbers. The report folder is marked and replaced like
the compare report's (rundir.output_folder).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from ..rundir import MANIFEST, inside, output_folder, parse_csv, read_file, read_manifest
from . import figures as F
from .load import ReportError
from .render import REPORT

PANELS = (("reward_mean", "mean reward"), ("mean_abs_dlogp", "mean |Δlogp| (trainer − engine)"))
ROW_COLUMNS = ("setting", "seed", "step", "reward_mean", "mean_abs_dlogp")  # what the figure and the caption read
NUMERIC = ("seed", "step", "reward_mean", "mean_abs_dlogp")


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


def _read(run_dir: Path, name: str, files: dict | None) -> bytes:
    """The bytes of run_dir/name, a file of the run folder itself; with `files` (the manifest's), they must have the
    sha256 it records."""
    path = inside(run_dir, name)
    data = read_file(path)
    if files is not None:
        record = files.get(name)
        if not isinstance(record, dict) or hashlib.sha256(data).hexdigest() != record.get("sha256"):
            raise ReportError(f"{path} is not the file the run wrote (its sha256 differs from the manifest's); "
                              "rerun the rl command")
    return data


def _files(run_dir: Path, check: bool) -> dict | None:
    if not check:
        return None
    if not (run_dir / MANIFEST).is_file() and not (run_dir / MANIFEST).is_symlink():
        raise ReportError(f"{run_dir} has no manifest.json: the rl run did not finish; its rows are in rl.csv")
    files = read_manifest(run_dir).get("files")
    if not isinstance(files, dict):
        raise ReportError(f"{run_dir / MANIFEST} has no `files` map of file records; rerun the rl command")
    return files


def read_rows(run_dir: Path, check: bool = True, files: dict | None = None) -> pd.DataFrame:
    run_dir = Path(run_dir)
    if not (run_dir / "rl.csv").is_file() and not (run_dir / "rl.csv").is_symlink():
        raise ReportError(f"{run_dir} has no rl.csv; pass the --out folder of an rl run")
    files = files if files is not None else _files(run_dir, check)
    rows = parse_csv(run_dir / "rl.csv", _read(run_dir, "rl.csv", files), ROW_COLUMNS, numeric=NUMERIC)
    if rows.empty:
        raise ReportError(f"{run_dir / 'rl.csv'} has no rows: the run stopped before its first step; rerun the rl "
                          "command")
    return rows


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
    files = _files(run_dir, check)
    rows = read_rows(run_dir, check, files)
    summary = None
    if (run_dir / "rl_summary.csv").is_file() or (run_dir / "rl_summary.csv").is_symlink():
        summary = parse_csv(run_dir / "rl_summary.csv", _read(run_dir, "rl_summary.csv", files), ("setting", "seed"))
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    with output_folder(out_dir, REPORT, replaces=REPORT) as tmp:
        F.save(rl_curves(rows), tmp / "figures", "rl")
        lines = ["# divergence-probe rl", "",
                 f"{rows.setting.nunique()} setting(s) x {rows.seed.nunique()} seed(s), {rows.step.max()} steps.", "",
                 "![reward and mismatch against step](figures/rl.png)", ""]
        if summary is not None:
            lines += [_markdown(summary), ""]
        (tmp / "report.md").write_text("\n".join(lines), encoding="utf-8")
    return out_dir / "report.md"
