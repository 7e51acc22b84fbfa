"""Write a run folder atomically: everything goes to a hidden sibling folder that is renamed into place
only when complete, so a failed or interrupted run leaves nothing half-written behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from ..errors import OutputError


def check_out_dir(out_dir: Path) -> None:
    """Fail before any expensive work if out_dir can't be created: it must be new or empty, its parent writable."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise OutputError(f"output directory {out_dir} already exists and is not empty; choose another --out")
    parent = out_dir.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.mkdtemp(prefix=f".{out_dir.name}.check-", dir=parent)
        os.rmdir(probe)
    except OSError as e:
        raise OutputError(f"cannot write to {parent} ({e.strerror}); choose a writable --out") from e


@contextmanager
def atomic_dir(out_dir: Path):
    """Yield a temporary folder; on success it becomes out_dir, on failure it is removed."""
    check_out_dir(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.absolute().parent))
    try:
        yield tmp
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_csv(df: pd.DataFrame, path: Path) -> None:
    # Shortest round-trip float repr and "\n" line ends: same numbers, same bytes, on every platform.
    df.to_csv(path, index=False, lineterminator="\n")


def write_json(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, default=str) + "\n")


def write_prompts(prompts, path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            record = {"prompt_id": p.prompt_id, "source": p.source, "text": p.text,
                      "token_ids": list(p.token_ids), "truncated": p.truncated}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def _write_common(run, tmp: Path) -> None:
    """What every run folder has: manifest, prompts, tokens and layers."""
    write_json(run.manifest, tmp / "manifest.json")
    write_prompts(run.prompts, tmp / "prompts.jsonl")
    write_csv(run.tokens_table, tmp / "tokens.csv")
    write_csv(run.layers_table, tmp / "layers.csv")


def write_compare_run(run, out_dir: Path) -> Path:
    with atomic_dir(out_dir) as tmp:
        _write_common(run, tmp)
        write_csv(pd.DataFrame([run.summary]), tmp / "summary.csv")
        if hasattr(run, "buckets_table"):
            write_csv(run.buckets_table, tmp / "buckets.csv")
        if run.batch_invariance is not None:
            write_csv(run.batch_invariance, tmp / "batch_invariance.csv")
    return out_dir


def write_ablation_run(run, out_dir: Path) -> Path:
    with atomic_dir(out_dir) as tmp:
        _write_common(run, tmp)
        write_csv(run.summary_table, tmp / "summary.csv")
        write_csv(run.ablation_table, tmp / "ablation.csv")
        write_csv(run.attribution_table, tmp / "attribution.csv")
    return out_dir
