"""The tool's per-machine cache folder: built models, the compiled tap reduction. No heavy imports: the CLI's start
asks for it (the built-in model's path)."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "DIVERGENCE_PROBE_HOME"


def cache_home() -> Path:
    """$DIVERGENCE_PROBE_HOME, else $XDG_CACHE_HOME/divergence-probe, else ~/.cache/divergence-probe. Never a run
    folder: what is kept here serves every later run on the machine."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "divergence-probe"
