"""A run folder read back, checked (read_run): a run folder is untrusted data, so its files stay inside it, each
listed file must have the sha256 its manifest records, and every table has its columns and its numbers."""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd

from .errors import one_line
from .rundir import COLUMNS, MANIFEST, MANIFEST_LIMIT, PROMPTS, RERUN, TOOL, RunFolderError

# score's tokens.csv holds the logprobs the user's run recorded (logprob_rollout) where compare's holds the engine's
KIND_COLUMNS = {"score": {"tokens.csv": ("prompt_id", "position", "logprob_rollout", "delta_logprob", "kl")},
                # score over many files (runs/history.py): a row per step instead of one summary row
                "history": {"steps.csv": ("step", "file"), "alarms.csv": ("metric", "threshold", "first_step")}}
OPTIONAL = ("tokens.csv",)
# The columns of each file the readers (report, diff) compute with: each value must be a number, or the file is
# refused naming the row. A run folder edited consistently with its manifest's hashes (or one older than them) is
# read as the tool wrote it otherwise. In summary.csv every metric whose name says it is one (SUMMARY_NUMBER_SUFFIXES)
# is checked too: the other columns may hold words (the first inexact tap, a floor's name).
NUMBERS = {
    "summary.csv": ("mean_abs_dlogp", "max_abs_dlogp", "p99_abs_dlogp", "mean_kl", "max_kl", "n_tokens"),
    "layers.csv": ("layer", "rel_l2"),
    "tokens.csv": ("position", "logprob_infer", "logprob_rollout", "delta_logprob", "kl"),
    "local.csv": ("layer", "local_rel_l2", "propagated_rel_l2"),
    "local_families.csv": ("local_rel_l2",),
    "local_routing.csv": ("layer", "frac_topk_set_differs"),
    "depth.csv": ("layer", "mean_abs_dlogp", "mean_kl"),
    "routing.csv": ("layer", "frac_topk_set_differs"),
    "routing_noise.csv": ("layer", "frac_topk_set_differs"),
    "reference_local.csv": ("layer", "ref_err_train"),
}
SUMMARY_NUMBER_SUFFIXES = ("_abs_dlogp", "_kl", "_ci_low", "_ci_high", "_over_floor")
# prompts.jsonl: each line a JSON object; the fields a reader uses, when there, of these types
PROMPT_FIELDS = {"prompt_id": (int, str), "source": (str,), "text": (str,), "token_ids": (list,), "truncated": (bool,)}
# A run's largest file, tokens.csv, holds ~150 bytes a scored token (per combination in an ablation); past this bound
# (on disk and once decompressed) a file is not one the tool wrote, and is not read: pandas holds several times it.
FILE_LIMIT = 2**30


@dataclass
class RunFolder:
    """A run folder as read back: the manifest, the prompt records and every table by file name."""

    path: Path
    manifest: dict
    prompts: list[dict] | None = None
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)

    def table(self, name: str) -> pd.DataFrame | None:
        """The table of `name` (e.g. "tokens.csv"), read from NAME or NAME.gz; None if neither is there."""
        return self.tables.get(name, self.tables.get(f"{name}.gz"))

    def file_of(self, name: str) -> str | None:
        return next((n for n in (name, f"{name}.gz") if n in self.tables), None)


def _cut(path: Path, detail: str) -> RunFolderError:
    return RunFolderError(f"{path} {detail}: the run folder is incomplete or was changed; restore the file or {RERUN}")


def inside(folder: Path, name: str) -> Path:
    """folder/name for a file name a manifest gives, refused (RunFolderError) unless it is a plain name of a
    regular file in the folder itself: `../x`, an absolute path or a link out would make a report read (and
    show) a file that is not part of the run."""
    where = Path(folder) / MANIFEST
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise RunFolderError(f"{where} lists {name!r} under `files`, which is not a file name in the run folder (a "
                             f"run folder holds its own files only); {RERUN}")
    path = Path(folder) / name
    if path.is_symlink():
        raise RunFolderError(f"{path} is a link (to {os.readlink(path)}), not a file of the run; a run folder holds "
                             f"its own files only: put the file itself there or {RERUN}")
    if path.exists() and not path.is_file():
        raise RunFolderError(f"{path} is not a regular file; a run folder holds its own files only: {RERUN}")
    return path


def read_manifest(folder: Path) -> dict:
    """folder/manifest.json as a JSON object, read with a size cap; RunFolderError when it is a link, too large,
    cut short or not an object."""
    path = inside(folder, MANIFEST)
    try:
        with path.open("rb") as f:
            data = f.read(MANIFEST_LIMIT + 1)
        if len(data) > MANIFEST_LIMIT:
            raise RunFolderError(f"{path} is larger than {MANIFEST_LIMIT // 2**20} MiB, so it is not a manifest "
                                 f"{TOOL} wrote; {RERUN}")
        manifest = json.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON, or a 5000-digit int
        raise RunFolderError(f"cannot read {path} ({one_line(e, 200)}); it is cut short or not a manifest {TOOL} "
                             f"wrote: {RERUN}") from e
    if not isinstance(manifest, dict):
        raise RunFolderError(f"{path} is not a JSON object; {RERUN}")
    return manifest


def parse_csv(path: Path, data: bytes, columns: Iterable[str] = (), drop: Iterable[str] = (),
              numeric: Iterable[str] = ()) -> pd.DataFrame:
    """A CSV file's bytes as a frame whose `columns` are all there (and `numeric` ones all numbers), or a
    RunFolderError naming the file. Only empty fields are missing values: tap labels like `none` and combo
    names stay strings."""
    drop = set(drop)
    try:
        df = pd.read_csv(io.BytesIO(data), keep_default_na=False, na_values=[""], usecols=lambda c: c not in drop)
        _check_fields(path, data)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError, csv.Error) as e:
        raise RunFolderError(f"cannot read {path} ({one_line(e, 200)}); it is not a file {TOOL} wrote, or it was "
                             f"cut short: {RERUN}") from e
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise RunFolderError(f"{path} lacks the column(s) {', '.join(missing)}; was it written by this version "
                             f"of {TOOL}? {RERUN[0].upper() + RERUN[1:]}")
    check_numbers(path, df, numeric)
    return df


def _check_fields(path: Path, data: bytes) -> None:
    """RunFolderError naming the first row whose number of fields is not its header's. pandas reads a first row
    with one field more as an index column, shifting every value one column left, drops extra fields of later
    rows when columns are chosen, and fills a short row with empty values: each reads as a table of wrong
    numbers. Streamed row by row, so the check holds no second copy of the file."""
    rows = csv.reader(io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", newline=""))
    header = next(rows, [])
    n = 0
    for row in rows:
        if not row:  # a blank line, which pandas skips as well
            continue
        n += 1
        if len(row) != len(header):
            raise RunFolderError(f"{path} row {n} (line {rows.line_num}) has {len(row)} fields, not the "
                                 f"{len(header)} of its header; it is not a file {TOOL} wrote, or it was edited: "
                                 f"{RERUN}")


def check_numbers(path: Path, df: pd.DataFrame, columns: Iterable[str]) -> None:
    """RunFolderError naming the first row where one of `columns` (those of the frame) holds no number."""
    for column in columns:
        if column in df.columns and (not pd.api.types.is_numeric_dtype(df[column])
                                     or pd.api.types.is_bool_dtype(df[column])):
            values = df[column]
            numbers = pd.to_numeric(values.where(values.map(type) != bool), errors="coerce")  # True is no number
            bad = (numbers.isna() & values.notna()).to_numpy()
            if not bad.any():  # no rows, or every value empty: nothing that is not a number
                continue
            row = int(bad.argmax())
            raise RunFolderError(f"{path} row {row + 1} (line {row + 2}): column {column} holds "
                                 f"{one_line(repr(values.iloc[row]), 60)}, not a number; it is not a file {TOOL} "
                                 f"wrote, or it was edited: {RERUN}")


def numbers_of(name: str, columns: Iterable[str]) -> tuple[str, ...]:
    """The columns of run file `name` (tokens.csv or tokens.csv.gz) that must hold numbers (NUMBERS)."""
    base = name.removesuffix(".gz")
    found = [c for c in columns if c in NUMBERS.get(base, ())
             or (base == "summary.csv" and c.endswith(SUMMARY_NUMBER_SUFFIXES))]
    return tuple(found)


def read_file(path: Path) -> bytes:
    """A file's content, gunzipped for .gz, read no further than FILE_LIMIT (on disk and once decompressed: a few
    MB of gzip can hold GBs); RunFolderError when it cannot be read or passes the bound."""
    try:
        if path.stat().st_size > FILE_LIMIT:
            raise RunFolderError(f"{path} is {path.stat().st_size / 2**30:.1f} GiB, over the {FILE_LIMIT // 2**30} "
                                 f"GiB of a run folder's file; it is not a file {TOOL} wrote: {RERUN}")
        with (gzip.open if path.name.endswith(".gz") else open)(path, "rb") as f:
            data = f.read(FILE_LIMIT + 1)
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise RunFolderError(f"cannot read {path} ({e}); it is not a file divergence-probe wrote, or it was "
                             f"cut short: {RERUN}") from e
    if len(data) > FILE_LIMIT:
        raise RunFolderError(f"{path} holds over {FILE_LIMIT // 2**30} GiB once decompressed, over the bound on a run "
                             f"folder's file; it is not a file {TOOL} wrote: {RERUN}")
    return data


def _columns(manifest: dict) -> dict[str, tuple]:
    """The columns each file of this run's kind must have (a manifest's `kind` is data: anything else is compare's)."""
    kind = manifest.get("kind")
    return COLUMNS | (KIND_COLUMNS.get(kind, {}) if isinstance(kind, str) else {})


def _parse_prompts(path: Path, data: bytes) -> list[dict]:
    """prompts.jsonl's records: each line a JSON object whose PROMPT_FIELDS have their types (token_ids: whole
    numbers); RunFolderError naming the line otherwise."""
    records = []
    n = 0
    try:
        for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
            if line.strip():
                records.append(_prompt_record(path, n, json.loads(line)))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON, or a 5000-digit int
        raise _cut(path, f"has a line that is not JSON (line {n}: {one_line(e, 200)})") from e
    return records


def _prompt_record(path: Path, n: int, record) -> dict:
    def bad(what: str) -> RunFolderError:
        return RunFolderError(f"{path} line {n}: {what}; it is not a file {TOOL} wrote, or it was edited: {RERUN}")

    if not isinstance(record, dict):
        raise bad(f"a JSON {type(record).__name__}, not an object of a prompt's fields")
    for name, types in PROMPT_FIELDS.items():
        value = record.get(name)
        if value is None:
            continue
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise bad(f"`{name}` is {one_line(repr(value), 60)}, not a {' or '.join(t.__name__ for t in types)}")
        if name == "token_ids" and not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise bad("`token_ids` holds something other than whole numbers")
    return record


def _check_listed(path: Path, name: str, hashed: bytes, record: dict, rows: Callable[[], int]) -> None:
    """Refuse a file whose bytes differ from what the manifest records for it, saying whether it was cut."""
    if hashlib.sha256(hashed).hexdigest() == record.get("sha256"):
        return
    expected = record.get("rows")
    try:
        found = rows()
    except RunFolderError:
        found = None
    if isinstance(expected, int) and found is not None and found < expected:
        raise _cut(path, f"is cut short ({found} of the {expected} rows the manifest lists)")
    raise _cut(path, f"does not match the sha256 the manifest records for {name}")


def read_run(run_dir: str | Path, drop: Iterable[str] = ()) -> RunFolder:
    """Read a run folder, checked: every file the manifest's `files` section lists must have its recorded
    sha256 (a file gzipped afterwards, NAME.gz, is checked by its content; tokens.csv may be deleted). Folders
    written before that section existed are checked for what can be: each file ends with a line break and
    parses with its columns, every prompts.jsonl line is JSON. `drop` names columns not to read (e.g. the
    token strings). RunFolderError on any failure."""
    path = Path(run_dir)
    if path.is_symlink() and path.exists():  # a link to a run folder is that folder: its files are checked there
        path = Path(os.path.realpath(path))
    if not path.exists():
        raise RunFolderError(f"run folder {path} does not exist; pass the --out folder of a compare, ablate or score "
                             "run")
    if not path.is_dir():
        raise RunFolderError(f"{path} is a file, not a run folder; pass the --out folder of a compare, ablate or "
                             "score run")
    table = "steps.csv" if (path / "steps.csv").is_file() else "summary.csv"  # a history's rows are its steps
    lacking = [f for f in (MANIFEST, table) if not (path / f).is_file() and not (path / f).is_symlink()]
    if lacking:
        raise RunFolderError(f"{path} is not a divergence-probe run folder (no {' or '.join(lacking)}); pass the "
                             "--out folder of a compare, ablate or score run")
    manifest = read_manifest(path)
    listed = manifest.get("files", {})
    if not isinstance(listed, dict) or not all(isinstance(r, dict) for r in listed.values()):
        raise RunFolderError(f"{path / MANIFEST} has a `files` entry that is not a map of file records; {RERUN}")
    for name in listed:
        inside(path, name)

    run = RunFolder(path=path, manifest=manifest)
    columns = _columns(manifest)
    known = (PROMPTS, *COLUMNS)
    bases = list(known) + list(dict.fromkeys(n.removesuffix(".gz") for n in listed
                                             if n.removesuffix(".gz") not in known))
    for base in bases:
        stored = next((inside(path, n) for n in (base, f"{base}.gz") if (path / n).is_file() or (path / n).is_symlink()),
                      None)
        if stored is None:
            if (base in listed or f"{base}.gz" in listed) and base not in OPTIONAL:
                raise _cut(path / base, "is listed in the manifest but missing")
            continue
        data = read_file(stored)
        if stored.name in listed:
            record, hashed = listed[stored.name], stored.read_bytes()
        elif base in listed:  # gzipped after the run: its content is what the manifest hashed
            record, hashed = listed[base], data
        else:
            record, hashed = None, data
        if record is None and data and not data.endswith(b"\n"):
            raise _cut(stored, "does not end with a line break, so it was cut short")
        if base == PROMPTS:
            if record is not None:
                _check_listed(stored, stored.name, hashed, record, lambda: len(_parse_prompts(stored, data)))
            run.prompts = _parse_prompts(stored, data)
        elif base in columns:
            if record is not None:  # hash first: a cut file may still parse, and must never be used
                _check_listed(stored, stored.name, hashed, record, lambda: len(parse_csv(stored, data, columns[base])))
            table = parse_csv(stored, data, columns[base], drop)
            check_numbers(stored, table, numbers_of(base, table.columns))
            run.tables[stored.name] = table
        elif record is not None:
            _check_listed(stored, stored.name, hashed, record, lambda: data.count(b"\n"))
    return run
