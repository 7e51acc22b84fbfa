"""The report of a run's history (score over many files, one per RL step: runs/history.py): what was scored, the
alarms and the first step each fired at, the history's figure (steps.csv's metrics against step, as the run drew
it) and a table of the steps, in Markdown, HTML or LaTeX (reports/document.py, as every run's report).

steps.csv and alarms.csv are read checked against the sha256 the manifest recorded (run_folder.read_run), before
anything is drawn; the report folder is marked and replaced like every report's (rundir.output_folder).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..run_folder import read_run
from ..rundir import output_folder
from . import document as doc
from . import figures as F
from .load import ReportError
from .output import FORMATS, REPORT, write_document
from .steps import FIGURE, steps_figure

TITLE = "divergence-probe score: a run's history"
# steps.csv columns the table shows, when the history has them (every one is score's, documented with it)
STEP_COLUMNS = (("step", doc.Column("step", "int")), ("file", doc.Column("file", "code")),
                ("n_rollouts", doc.Column("rollouts", "int")), ("reward_mean", doc.Column("mean reward", "num")),
                ("mean_abs_dlogp", doc.Column("mean |Δlogp|", "num")), ("k3", doc.Column("k3", "num")),
                ("frac_abs_dlogp_over_ln2", doc.Column("|Δlogp| > ln 2", "pct")),
                ("ppo_clip_frac", doc.Column("PPO-clipped", "pct")), ("likely_cause", doc.Column("likely cause", "code")))


def _first(value) -> int | None:
    return None if pd.isna(value) else int(value)


def history_document(manifest: dict, steps: pd.DataFrame, alarms: pd.DataFrame) -> list:
    """The report's blocks (reports/document.py), rendered to any of its formats."""
    history = manifest.get("history") if isinstance(manifest.get("history"), dict) else {}
    score = manifest.get("score") if isinstance(manifest.get("score"), dict) else {}
    trainer = ("the trainer's logprobs the files record (no model loaded)" if score.get("trainer") == "recorded"
               else "the training stack, scoring each step's file")
    setup = [f"Steps: {len(steps)} files, `{steps['file'].iloc[0]}` to `{steps['file'].iloc[-1]}`; step numbers "
             f"from {history.get('steps_from', 'the file order')}",
             f"Trainer side: {trainer}; the recorded logprobs stand for the inference side"]
    fired = [f"`{a.metric}` {a.op} {doc.sig(float(a.threshold))}: first at step {_first(a.first_step)} "
             f"({doc.sig(float(a.value))})" for a in alarms.itertuples() if _first(a.first_step) is not None]
    quiet = [f"`{a.metric}` {a.op} {doc.sig(float(a.threshold))}: never" for a in alarms.itertuples()
             if _first(a.first_step) is None]
    shown = [(key, column) for key, column in STEP_COLUMNS if key in steps]
    return [
        doc.Heading(TITLE, 1),
        doc.Paragraph("Each step's rollout file scored as `score` scores one file: the recorded logprobs against the "
                      "trainer's, with the RL metrics a trainer would see. An alarm marks the first step at which its "
                      "metric rose past its threshold (a starting point, not a verdict)."),
        doc.Heading("Setup", 2), doc.Bullets(tuple(setup)),
        doc.Heading("Alarms", 2), doc.Bullets(tuple(fired + quiet) or ("No alarm was set.",)),
        doc.Heading("Metrics by step", 2),
        doc.Figure(FIGURE, "Alarmed metrics against step",
                   "One panel per alarm: the metric at each step, its threshold (dashed) and the first step past it; "
                   "the mean reward beside the first panel when the files record one."),
        doc.Heading("Steps", 2),
        doc.Table("steps", "One row per step (steps.csv holds every summary column of score).",
                  tuple(column for _, column in shown),
                  tuple(tuple(row[key] for key, _ in shown) for _, row in steps.iterrows())),
    ]


def write_history_report(run_dir: str | Path, out_dir: str | Path | None = None, fmt: str = "md") -> Path:
    """report.md, report.html or report.tex and figures/steps.png|pdf, into out_dir (default run_dir/report)."""
    folder = read_run(run_dir)
    if folder.manifest.get("kind") != "history" or "alarms.csv" not in folder.tables:
        raise ReportError(f"{folder.path} has steps.csv but is not the folder of a score over many files (its "
                          "manifest's kind is not history, or alarms.csv is missing); rerun that score")
    steps, alarms = folder.tables["steps.csv"], folder.tables["alarms.csv"]
    if steps.empty:
        raise ReportError(f"{folder.path / 'steps.csv'} has no rows; rerun the score that made the run folder")
    out_dir = Path(out_dir) if out_dir is not None else folder.path / "report"
    if out_dir.resolve() == folder.path.resolve():
        raise ReportError(f"--out {out_dir} is the run folder itself; choose another --out (default: RUN_DIR/report)")
    panels = [(str(a.metric), float(a.threshold), _first(a.first_step)) for a in alarms.itertuples()]
    blocks = history_document(folder.manifest, steps, alarms)
    with output_folder(out_dir, REPORT, replaces=REPORT) as tmp:
        F.save(steps_figure(steps, panels), tmp / doc.FIGURE_DIR, FIGURE)
        write_document(tmp, blocks, fmt, TITLE)
    return out_dir / FORMATS[fmt]
