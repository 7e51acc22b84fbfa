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

from .errors import OutputError


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


def write_run(out_dir: Path, manifest: dict, prompts, tables: dict) -> Path:
    with atomic_dir(out_dir) as tmp:
        write_json(manifest, tmp / "manifest.json")
        write_prompts(prompts, tmp / "prompts.jsonl")
        for name, frame in tables.items():
            write_csv(frame, tmp / name)
    return out_dir


def read_manifest(run_dir: Path) -> dict:
    path = Path(run_dir) / "manifest.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OutputError(f"cannot read {path} ({e}); point at a run folder written by compare or ablate") from e
