"""Rows of a rollout file: JSONL (optionally gzipped) or Parquet, each row a JSON object / a table row.

A rollout file is the user's data, possibly cut short, not a rollout file at all, or built to be small on disk and
huge in memory (a gzip or Parquet file that expands a thousandfold, a sparse file): it is read as a stream, row by
row, and refused at the first bound it passes (bytes on disk, bytes once decompressed, bytes of one row, rows, values
a Parquet file's metadata declares), before what passes the bound is held. Every way it can fail is one RolloutError
naming the file, the row and what to do.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import zlib
from pathlib import Path

from ..errors import one_line
from .record import RolloutError

# Rollouts of one RL step are megabytes to a few hundred MB. Each bound holds the Python objects the rows become to
# a few GiB (a JSON number becomes an object of tens of bytes); past one, the file is split or is not a rollout file.
MAX_BYTES = 2 * 2**30  # of the file on disk, and of its rows once decompressed
MAX_ROW_BYTES = 256 * 2**20  # of one row (a JSONL line): a million tokens with their logprobs take ~30 MB
MAX_ROWS = 2**20
MAX_VALUES = 2**27  # values in a Parquet file (each list element counted), as its metadata declares them
SPLIT = "split it (e.g. one RL step per file)"
JSONL = (".jsonl", ".ndjson", ".json", ".jsonl.gz", ".ndjson.gz", ".json.gz")
PARQUET = (".parquet", ".pq")


def read_rows(path: Path) -> tuple[list[dict], str]:
    """Every row of the file, as dicts, and the sha256 of the bytes they were parsed from (read once: a file
    replaced meanwhile cannot have its hash recorded beside another file's rows); RolloutError for a missing, empty,
    oversized or malformed file."""
    path = Path(path)
    data = _read_once(path)
    name = path.name.lower()
    if name.endswith(PARQUET):
        rows = _parquet(path, data)
    elif name.endswith(JSONL):
        rows = _jsonl(path, data, gzipped=name.endswith(".gz"))
    else:
        raise RolloutError(f"{path}: unknown rollout file type; name it .jsonl, .jsonl.gz or .parquet")
    if not rows:
        raise RolloutError(f"rollout file {path} holds no rows; pass the file your RL run wrote")
    return rows, hashlib.sha256(data).hexdigest()


def _read_once(path: Path) -> bytes:
    """The file's bytes from one open file, which must be a regular file (a pipe or device would block or never
    end: opened without waiting, refused by what the descriptor is)."""
    missing = RolloutError(f"rollout file {path} does not exist or is not a file; pass a .jsonl, .jsonl.gz or "
                           ".parquet file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise missing from None
    except OSError as e:
        raise RolloutError(f"cannot read {path} ({e.strerror or one_line(e, 120)})") from e
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise missing
        if info.st_size == 0:
            raise RolloutError(f"rollout file {path} is empty; pass the file your RL run wrote")
        if info.st_size > MAX_BYTES:
            raise RolloutError(f"rollout file {path} is {info.st_size / 2**30:.1f} GiB, over the {MAX_BYTES // 2**30} "
                               f"GiB this command reads; {SPLIT}")
        try:
            return f.read(info.st_size + 1)  # the size it had when opened (a buffer is not sized by the bound)
        except OSError as e:
            raise RolloutError(f"cannot read {path} ({e.strerror or one_line(e, 120)})") from e


def _jsonl(path: Path, data: bytes, gzipped: bool) -> list[dict]:
    rows, total = [], 0
    line_no = 0
    try:
        with (gzip.GzipFile(fileobj=io.BytesIO(data)) if gzipped else io.BytesIO(data)) as f:
            # readline(limit): a line is never read past the row bound, however long it runs (a newline-free
            # gzip bomb, a sparse file of zeros)
            while line := f.readline(MAX_ROW_BYTES + 1):
                line_no += 1
                total += len(line)
                if len(line) > MAX_ROW_BYTES:
                    raise RolloutError(f"{path} line {line_no} is over {MAX_ROW_BYTES // 2**20} MiB (the bound on one "
                                       "row); it is not a rollout row: pass the file your RL run wrote")
                if total > MAX_BYTES:
                    raise RolloutError(f"{path} holds over {MAX_BYTES // 2**30} GiB of rows once decompressed "
                                       f"(the bound on a rollout file); {SPLIT}")
                if not line.strip():
                    continue
                if len(rows) == MAX_ROWS:
                    raise RolloutError(f"{path} holds over {MAX_ROWS} rows (the bound on a rollout file); {SPLIT}")
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as e:
                    raise RolloutError(f"{path} line {line_no} is not JSON ({one_line(e, 120)}); the file is cut "
                                       "short or not JSONL: one JSON object per line is needed") from e
                if not isinstance(row, dict):
                    raise RolloutError(f"{path} line {line_no} is a JSON {type(row).__name__}, not an object; each "
                                       "line must be one rollout as a JSON object")
                rows.append(row)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise RolloutError(f"{path} is not a complete gzip file ({one_line(e, 120)}, after line {line_no}); it was "
                           "cut short: copy it again") from e
    except OSError as e:
        raise RolloutError(f"cannot read {path} ({e.strerror or one_line(e, 120)})") from e
    return rows


def _parquet(path: Path, data: bytes) -> list[dict]:
    """The rows, read a record batch at a time after the metadata's row and value counts are checked: a few kB of
    run-length-encoded Parquet can declare a billion values, which would otherwise be decoded before any check."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise RolloutError("reading Parquet needs pyarrow, which is not installed: `pip install pyarrow`, or "
                           "convert the file to JSONL") from e
    try:
        file = pq.ParquetFile(io.BytesIO(data))
        meta = file.metadata
        if meta.num_rows > MAX_ROWS:
            raise RolloutError(f"{path} holds {meta.num_rows} rows, over the {MAX_ROWS} of a rollout file; {SPLIT}")
        chunks = [meta.row_group(g).column(c) for g in range(meta.num_row_groups)
                  for c in range(meta.num_columns)]
        values = sum(chunk.num_values for chunk in chunks)
        expanded = sum(chunk.total_uncompressed_size for chunk in chunks)
        if values > MAX_VALUES or expanded > MAX_BYTES:
            raise RolloutError(f"{path} declares {values} values ({expanded / 2**30:.1f} GiB decoded), over the "
                               f"{MAX_VALUES} values or {MAX_BYTES // 2**30} GiB of a rollout file; {SPLIT}")
        rows = []
        for batch in file.iter_batches(batch_size=1024):
            rows.extend(batch.to_pylist())
        return rows
    except RolloutError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for every unreadable file
        raise RolloutError(f"cannot read {path} as Parquet ({one_line(e, 160)}); it is cut short or not a "
                           "Parquet file") from e
