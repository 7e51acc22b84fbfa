"""`option()`: a dataclass field that also describes its command-line flag, so a spec field is declared once.

The CLI builds every command's options from these fields (cli.py), and the manifest records the same fields
as data; a new option is one field. Kept free of imports so every layer, stacks included, can use it.
"""

from __future__ import annotations

from dataclasses import MISSING, field


def option(default=MISSING, help: str = "", *, flag: str | None = None, short: str | None = None,
           cli: bool = True, default_factory=MISSING):
    """A field with its flag's help text. `flag` overrides the `--field-name` spelling; `cli=False` keeps the
    field out of the command line (it is filled in by the tool, e.g. a seed derived from the run's seed)."""
    metadata = {"help": help, "flag": flag, "short": short, "cli": cli}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)
