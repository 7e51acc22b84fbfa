"""An rl run's rows (rl.csv), read for its report and for a rerun: checked against the sha256 the manifest recorded,
with the columns the figure and the tables read, as numbers. Apart from the report's drawing, so a rerun that only
checks a run finished unchanged reads it without the report's figures and prose."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd

from ..run_folder import inside, parse_csv, read_file, read_manifest
from ..rundir import MANIFEST, RunFolderError as ReportError

TIMES = ("t_rollout", "t_reward", "t_update", "t_metrics", "t_sync", "t_check")
# what the figure, the summary and the verdict read
NUMERIC = ("seed", "step", "reward_mean", "mean_abs_dlogp", "k3", "ppo_clip_frac", "entropy", "grad_norm", *TIMES)
ROW_COLUMNS = ("setting", *NUMERIC)


def read_checked(run_dir: Path, name: str, files: dict | None) -> bytes:
    """The bytes of run_dir/name, a file of the run folder itself; with `files` (the manifest's), they must have the
    sha256 it records."""
    path = inside(run_dir, name)
    data = read_file(path)
    if files is not None:
        record = files.get(name)
        if not isinstance(record, dict) or hashlib.sha256(data).hexdigest() != record.get("sha256"):
            raise ReportError(f"{path} is not the file the run wrote (its sha256 differs from the manifest's); "
                              "rerun the rl command")
    return data


def files_of(run_dir: Path, check: bool) -> dict | None:
    if not check:
        return None
    if not (run_dir / MANIFEST).is_file() and not (run_dir / MANIFEST).is_symlink():
        raise ReportError(f"{run_dir} has no manifest.json: the rl run did not finish; its rows are in rl.csv")
    files = read_manifest(run_dir).get("files")
    if not isinstance(files, dict):
        raise ReportError(f"{run_dir / MANIFEST} has no `files` map of file records; rerun the rl command")
    return files


def read_rows(run_dir: Path, check: bool = True, files: dict | None = None) -> pd.DataFrame:
    run_dir = Path(run_dir)
    if not (run_dir / "rl.csv").is_file() and not (run_dir / "rl.csv").is_symlink():
        raise ReportError(f"{run_dir} has no rl.csv; pass the --out folder of an rl run")
    files = files if files is not None else files_of(run_dir, check)
    rows = parse_csv(run_dir / "rl.csv", read_checked(run_dir, "rl.csv", files), ROW_COLUMNS, numeric=NUMERIC)
    if rows.empty:
        raise ReportError(f"{run_dir / 'rl.csv'} has no rows: the run stopped before its first step; rerun the rl "
                          "command")
    twice = rows[rows.duplicated(["setting", "seed", "step"])]
    if len(twice):  # one setting run twice under one name would be summarized as one run of twice the steps
        first = twice.iloc[0]
        raise ReportError(f"{run_dir / 'rl.csv'} holds step {first.step} of setting {first.setting!r}, seed "
                          f"{first.seed} twice (a setting given twice in another order, by a version that ran it "
                          "twice); rerun the rl command with each setting once")
    return rows
