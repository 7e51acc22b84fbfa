"""`option()`: a dataclass field that also describes its command-line flag, so a spec field is declared once.

The CLI builds every command's options from these fields (cli/options.py), and the manifest records the same fields
as data; a new option is one field. Kept free of imports so every layer, stacks included, can use it and sit no
deeper in the import graph for it. `finite_number` is the one test of a number-valued option, for its flag
(spec/fields.py's `check_finite`, from each spec's __post_init__) and for the manifest field a rerun or a report reads
(spec._typed).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, field


def option(default=MISSING, help="", *, flag: str | None = None, short: str | None = None,
           cli: bool = True, default_factory=MISSING, repeat: bool = False):
    """A field with its flag's help text (or a function of none returning it, called when the command is built: help
    that says what this environment has installed). `flag` overrides the `--field-name` spelling; `cli=False` keeps the
    field out of the command line (it is filled in by the tool, e.g. a seed derived from the run's seed); `repeat`: a
    list field whose flag may be given several times (each a comma list)."""
    metadata = {"help": help, "flag": flag, "short": short, "cli": cli, "repeat": repeat}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def finite_number(value) -> bool:
    """Whether value can be a number-valued option: a number (a bool is not one) that is finite. inf and nan pass
    most range checks (inf > 1) or fail them all silently, and a run made with one could never be re-run."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

