"""A run folder's manifest, built one way for every kind (compare, ablate, score, rl, history): what was loaded (the
model, the load settings, the stacks, the environment), the kind, the spec that re-makes the run, the command that
made it, and the kind's own sections. Readers (rerun, report, diff) find the same keys wherever a run came from.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping, Sequence

CONSOLE_SCRIPT = "divergence-probe"
MODULE_COMMAND = ("python", "-m", "divergence_probe")
_PACKAGE_MAIN = Path(__file__).resolve().parents[1] / "__main__.py"


def model_section(source) -> dict:
    """The checkpoint a run read (a models.source.ModelSource), as a reader needs it to reproduce the run; rerun
    checks config_sha256."""
    return {"spec": source.spec, "path": str(source.path), "arch": source.arch, "num_layers": source.num_layers,
            "config_sha256": source.config_sha256}


def runnable_command(argv: Sequence[str] | None = None) -> list[str]:
    """`argv` (this process's sys.argv) as a command line a reader can run again. `python -m divergence_probe` puts
    the package's __main__.py in argv[0], a file path that runs nothing when typed: it is recorded as the module
    command. The console script is recorded by its name, which any environment with the tool installed runs, not by
    the path of one virtual environment's copy. Any other program (a script calling the API) is kept as started."""
    program, *args = sys.argv if argv is None else argv
    if Path(program).resolve() == _PACKAGE_MAIN:
        return [*MODULE_COMMAND, *args]
    if Path(program).stem == CONSOLE_SCRIPT:
        return [CONSOLE_SCRIPT, *args]
    return [program, *args]


def build_manifest(kind: str, setup: Mapping, sections: Mapping, *, spec: dict | None = None,
                   command: Sequence[str] | None = None) -> dict:
    """The manifest of a run of `kind`: `setup` (what was loaded: a probe's or a scorer's manifest; {} for a run
    that loads nothing), then the kind's `sections`, the `spec` a rerun reads back and the `command` line."""
    manifest = {**setup, "kind": kind, **sections}
    if spec is not None:
        manifest["spec"] = spec
    if command is not None:
        manifest["command"] = list(command)
    return manifest
