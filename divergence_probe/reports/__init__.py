"""Reports of run folders: load, prose, figure_specs, figures, document (md/html/LaTeX), render (write_report)."""

from .load import ReportError
from .render import FORMATS, MARKER, write_report

__all__ = ["write_report", "ReportError", "FORMATS", "MARKER"]
