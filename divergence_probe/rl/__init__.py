"""`divergence-probe rl`: a small GRPO loop (vLLM rollouts, transformers updates, weight sync verified every step).

    import divergence_probe.rl as rl
    result = rl.run(rl.RLSpec(steps=20), out_dir="runs/rl")       # rl.csv, rl_summary.csv, manifest.json

Modules: reward (the task, plug-ins), grpo (advantages, loss), trainer (FP32 masters, BF16 compute), sync (push,
checksums, stale-cache probe), loop (the steps), table (the run folder), spec (the options).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from ..prompts import read_prompt_sources
from .loop import Loop, load
from .reward import load_reward
from .spec import RLSpec
from .sync import StaleCacheError, SyncError
from .table import rl_folder, summarize

Progress = Callable[[dict, int, int], None]  # (row, rows done, rows in all)


@dataclass
class RLResult:
    spec: RLSpec
    rows: pd.DataFrame
    summary: pd.DataFrame
    manifest: dict
    out_dir: Path


def run(spec: RLSpec, out_dir: str | Path, progress: Progress | None = None, probe=None) -> RLResult:
    """Every (setting, seed) run of `spec` on one engine; rows go to OUT/rl.csv as they are made.
    `probe`: an already loaded rl probe (`rl.loop.load(spec)`); default: load one."""
    out_dir = Path(out_dir)
    load_reward(spec.reward)  # a bad plug-in or prompt file fails in seconds, before the engine starts
    if spec.prompts is not None:
        read_prompt_sources(Path(spec.prompts))
    with rl_folder(out_dir) as writer:
        probe = probe or load(spec)
        loop = Loop(probe, spec)
        rows: list[dict] = []
        total = len(spec.settings) * len(spec.seed_list) * spec.steps

        def keep(row: dict) -> None:
            writer.add(row)
            rows.append(row)
            if progress is not None:
                progress(row, len(rows), total)

        for seed in spec.seed_list:  # seed by seed: a stopped experiment keeps whole comparisons of the settings
            for setting in spec.settings:
                loop.run(setting, seed, keep)
        table = pd.DataFrame(rows)
        summary = summarize(table)
        manifest = {"kind": "rl", "spec": spec.to_dict(), "command": list(sys.argv), **probe.manifest(),
                    "rl": {"engine_args": dict(probe.config.engine_args), "settings": list(spec.settings),
                           "seeds": list(spec.seed_list), "trainer": "FP32 master weights, AdamW (0.9, 0.95), "
                           "BF16 compute model; BF16 weights pushed"}}
        writer.finish(manifest, summary)
    return RLResult(spec, table, summary, manifest, out_dir)


__all__ = ["Loop", "RLResult", "RLSpec", "StaleCacheError", "SyncError", "load", "run"]
