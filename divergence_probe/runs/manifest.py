"""A run folder's manifest, built one way for every kind (compare, ablate, score, rl, history): what was loaded (the
model, the load settings, the stacks, the environment), the kind, the spec that re-makes the run, the command that
made it, and the kind's own sections. Readers (rerun, report, diff) find the same keys wherever a run came from.
"""

from __future__ import annotations

from typing import Mapping, Sequence


def model_section(source) -> dict:
    """The checkpoint a run read (a models.source.ModelSource), as a reader needs it to reproduce the run; rerun
    checks config_sha256."""
    return {"spec": source.spec, "path": str(source.path), "arch": source.arch, "num_layers": source.num_layers,
            "config_sha256": source.config_sha256}


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
