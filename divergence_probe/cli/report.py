"""`report`: a run folder rendered as a report (reports/render.py; an rl run's: reports/rl.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .options import help_from_doc
from .runner import write_report


@help_from_doc
def report_command(
    run_dir: Path = typer.Argument(..., help="A run folder (the --out of compare, ablate, score or rl)."),
    fmt: str = typer.Option("md", "--format", "-f", help="md (report.md + PNG/PDF figures), html (one self-contained report.html) or latex (report.tex, booktabs tables, PDF figures)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="New or empty folder, or one holding a previous report (replaced). Default: RUN_DIR/report."),
) -> None:
    """Render a run folder as a report a reader understands without the tool: setup, headline numbers,
    first divergence, tables and figures (error growth across layers, Δlogprob, KL by position, attribution).

    Examples:
      divergence-probe report runs/normal
      divergence-probe report runs/normal --format html --out reports/normal
    """
    write_report(run_dir, out_dir, fmt)
