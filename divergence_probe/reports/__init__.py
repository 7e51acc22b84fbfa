"""Reports of run folders: load.py (a run folder as RunData), prose.py (the text), figure_specs.py (which
figures, with captions), figures.py (drawing), document.py (md/html/LaTeX rendering), render.py (write_report)."""

from .load import ReportError
from .render import FORMATS, MARKER, write_report

__all__ = ["write_report", "ReportError", "FORMATS", "MARKER"]
