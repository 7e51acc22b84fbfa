"""write_report: render a run folder (compare, ablate or generate) into a report folder, atomically.

    from divergence_probe.reports import write_report
    write_report("runs/qwen")                         # runs/qwen/report/report.md + figures/*.png|pdf
    write_report("runs/qwen", fmt="html")             # one self-contained report.html (PNGs inlined, no figures/)
    write_report("runs/qwen", "paper/", fmt="latex")  # report.tex, summary.tex, ablation.tex, ... + PDFs

The run type is read from the files present: ablation.csv makes an ablate run; a `generate` manifest section
or tokens with `is_response` make a generate run; otherwise a compare run. tokens.csv may also be
tokens.csv.gz, or absent (then the token figures are skipped and the report says so). A cut or changed file
is refused before anything is written (run_folder.read_run).

Output is written like every other output of the tool (rundir.atomic_dir): into a hidden sibling folder
renamed into place when complete, removed on any failure or interrupt. A folder that holds exactly a previous
report (the tool's mark, rundir.MARK, says so and lists its files) is replaced on re-render; any other
non-empty folder is an OutputError and is left untouched. Identical inputs give byte-identical output: nothing in it depends on the
time, the machine or the out path.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import OutputError
from ..rundir import MARK, output_folder
from . import document as doc
from .figure_specs import figure_specs
from .load import ReportError, load_run
from .run_data import RunData
from .output import FORMATS, REPORT, write_document
from .prose import build_document, title

MARKER = MARK  # the tool's mark in a report folder (it lists the files), so a re-render may replace it


def _render(run: RunData, out: Path, fmt: str) -> None:
    from . import figures as F

    specs, skipped = figure_specs(run)
    if fmt == "html":  # one file: the figures live in it as data URIs, no figures/ folder beside it
        images = {spec.stem: F.png_bytes(spec.draw()) for spec in specs}
        write_document(out, build_document(run, specs, skipped, figure_files=False), fmt, title(run), images)
        return
    for spec in specs:
        F.save(spec.draw(), out / doc.FIGURE_DIR, spec.stem)
    write_document(out, build_document(run, specs, skipped), fmt, title(run))


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, fmt: str = "md") -> Path:
    """Render the run folder `run_dir` into `out_dir` (default: run_dir/report); return the main file
    (report.md, report.html or report.tex). Raises ReportError for a bad run folder and OutputError for an
    out_dir that is neither new, empty nor a previous report."""
    if fmt not in FORMATS:
        raise ReportError(f"--format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if (Path(run_dir) / "steps.csv").is_file():  # score over many files: a history, rendered by its steps
        from .history import write_history_report

        return write_history_report(run_dir, out_dir, fmt)
    run = load_run(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    if out_dir.resolve() == run.path.resolve():
        raise OutputError(f"--out {out_dir} is the run folder itself; choose another --out (default: RUN_DIR/report)")
    with output_folder(out_dir, REPORT, replaces=REPORT) as tmp:
        _render(run, tmp, fmt)
    return out_dir / FORMATS[fmt]
