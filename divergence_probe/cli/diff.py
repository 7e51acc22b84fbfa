"""`diff`: what moved between two runs of the same prompts and model (reports/diff.py), as a table and its files."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..errors import ProbeError
from .console import fail, out, say
from .options import help_from_doc


@help_from_doc
def diff_command(
    run_a: Path = typer.Argument(..., help="The first run folder (before: e.g. the old engine or trainer)."),
    run_b: Path = typer.Argument(..., help="The second run folder, of the same prompts and model (after)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="New or empty folder for the diff's files. "
                                           "Default: runs/<date>-<time>-<microseconds>."),
) -> None:
    """Show what moved between two runs of the same prompts and model: summary metrics with both runs' noise floors,
    layers whose error grew, tokens whose |Δlogp| moved most, routing per layer, and the settings that differ.

    Writes diff_summary.csv, diff_layers.csv, diff_tokens.csv, diff_manifest.csv (and diff_routing.csv for a
    mixture of experts) and diff.md. Runs of other prompts or another model are refused.

    Examples:
      divergence-probe diff runs/before runs/after
      divergence-probe diff runs/shipped runs/rope-aligned --out runs/what-rope-moved
    """
    from ..reports.diff import TOP, diff_runs
    from ..rundir import default_out_dir

    try:
        diff = diff_runs(run_a, run_b)
        out_dir = diff.write(out_dir or default_out_dir())
    except ProbeError as e:
        fail(e)
    table = Table(title="A → B (diff_summary.csv)")
    for col in ("metric", "A", "B", "B / A"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for row in diff.summary.itertuples():
        shown = [f"{v:.3e}" if isinstance(v, float) else str(v) for v in (row.a, row.b)]
        table.add_row(row.metric + (" (noise floor)" if row.noise_floor else ""), *shown,
                      "" if row.ratio != row.ratio else f"{row.ratio:.3g}")
    out.print(table)
    grew = diff.layers[diff.layers["grew"]]
    out.print(f"layers whose error grew: {len(grew)} of {len(diff.layers)}; tokens lined up: {len(diff.tokens)}; "
              f"settings that differ: {len(diff.manifest)}", highlight=False)
    for row in diff.manifest.head(TOP).itertuples():
        say(f"  {row.key}: {row.a} -> {row.b}")
    say(f"diff: {out_dir}")

