"""A VLLM_CACHE_ROOT of its own for each engine build whose compiled graph vLLM's own cache keys cannot tell apart
from another's: aligned regions (aligned.cache_namespace). (A build with tap points runs with the cache off instead:
vLLM 0.24 on CUDA cannot serialize its graph; engine_start._building.)

vLLM's AOT compile cache (on by default with torch >= 2.10) is keyed by the vLLM config, its compile-relevant
environment variables and the model forward's name, not by which Python code the trace inlined; its backend cache
adds the traced files. Code patched into the model, or hooks on it, change none of those, so two such builds share one
key and whichever compiled first would be loaded by the other. The key's only lever outside the config is where the
cache lives: each build compiles under a subfolder of the user's root named by what it patched in and the sha256 of
that code's source files. Inductor's own caches are keyed by graph content and follow VLLM_CACHE_ROOT in AOT mode.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Sequence


def namespace(subdir: str, label: str, parts: Sequence[tuple[str, set[str]]], root: str | None = None) -> str:
    """A VLLM_CACHE_ROOT of its own for builds whose graph vLLM's cache key cannot tell apart: `subdir/label-digest`
    inside the user's root, the digest over each part's name and the source files of its modules (`parts`: (name,
    module names)), so an edit to that code compiles anew and a build of other parts never meets this one's graph."""
    digest = hashlib.sha256()
    for name, modules in parts:
        digest.update(name.encode() + b"\0")
        for source in sorted(modules):
            digest.update(Path(sys.modules[source].__file__).read_bytes())
    base = root or os.environ.get("VLLM_CACHE_ROOT") or _default_vllm_cache_root()
    return str(Path(base) / subdir / f"{label}-{digest.hexdigest()[:16]}")


def sources(module, packages: frozenset[str] = frozenset({"divergence_probe.regions"})) -> set[str]:
    """The modules whose code `module` runs: its own, and those of its package and of `packages` it takes code from,
    followed through what they take in turn (residual's region patch runs rmsnorm's patch, which runs rmsnorm's
    norm)."""
    packages = {module.__name__.rpartition(".")[0], *packages}
    found, todo = set(), [module.__name__]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        todo += [m for m in (getattr(value, "__module__", None) for value in vars(sys.modules[name]).values())
                 if m and m.rpartition(".")[0] in packages]
    return found


def _default_vllm_cache_root() -> str:
    """vLLM's own default (vllm/envs.py), without importing vLLM."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vllm")
