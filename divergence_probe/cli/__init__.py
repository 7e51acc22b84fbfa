"""The `divergence-probe` command: a thin typer shell over the Python API (parse -> API -> rich).

app.py holds the group and the entry point, options.py makes every command's options from its spec class,
console.py what the command line shows (phase lines, tables' width, progress, error lines), runner.py what every run
command does around its API call, and each command is a module of its own (compare.py: compare and ablate).
"""

from .app import app, main

__all__ = ["app", "main"]
