"""Rows of a rollout file: JSONL (optionally gzipped) or Parquet, each row a JSON object / a table row.

A rollout file is the user's data, possibly cut short, not a rollout file at all, or built to be small on disk and
huge in memory (a gzip or Parquet file that expands a thousandfold, a sparse file): it is read as a stream, row by
row, and refused at the first bound it passes (bytes on disk, bytes once decompressed, bytes of one row, rows, values
of one row and of the file, values a Parquet file's metadata declares, strings a Parquet dictionary repeats), before
what passes the bound is held. Every way it can fail is one RolloutError naming the file, the row and what to do; so
is running out of memory below the bounds (a tighter limit than the bounds were set for), never a format error.

What a read holds grows with the values read (every list entry: a token id, a logprob), not with the bytes: a
value becomes a Python object the scoring keeps as a row of its tables. So the values are the bound that sets the
memory (docs/reference/errors.md states what each bound costs); the byte bounds only keep the parse itself bounded.
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
MAX_BYTES = 2**30  # of the file on disk (held while read), and of its rows once decompressed
MAX_ROWS = 2**20
MAX_VALUES = 2**24  # values (list entries, at any depth) of all rows of a file; a Parquet file's as its metadata declares
# values of one row: a response past any model's context (a few hundred thousand tokens) with both logprob columns
MAX_ROW_VALUES = 2**21
# of one row (a JSONL line): MAX_ROW_VALUES values written out take ~40 MB; the line is held while it is parsed
MAX_ROW_BYTES = 64 * 2**20
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
    rows, total, values = [], 0, 0
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
                # every list entry but the last of its list is followed by a comma: a line of more commas than twice
                # the bound (text fields have some) is refused before the parse makes an object of each
                if line.count(b",") > 2 * MAX_ROW_VALUES:
                    _over_row(path, f"line {line_no}", f"{line.count(b',')} commas")
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as e:
                    raise RolloutError(f"{path} line {line_no} is not JSON ({one_line(e, 120)}); the file is cut "
                                       "short or not JSONL: one JSON object per line is needed") from e
                if not isinstance(row, dict):
                    raise RolloutError(f"{path} line {line_no} is a JSON {type(row).__name__}, not an object; each "
                                       "line must be one rollout as a JSON object")
                values = _counted(path, f"line {line_no}", row, values)
                rows.append(row)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise RolloutError(f"{path} is not a complete gzip file ({one_line(e, 120)}, after line {line_no}); it was "
                           "cut short: copy it again") from e
    except MemoryError:
        raise _out_of_memory(path, f"line {line_no}") from None
    except OSError as e:
        raise RolloutError(f"cannot read {path} ({e.strerror or one_line(e, 120)})") from e
    return rows


def row_values(row: dict) -> int:
    """The values a row holds: its fields and every list entry or object member at any depth (each a Python object
    once parsed)."""
    n, stack = len(row), [v for v in row.values() if isinstance(v, (list, dict))]
    while stack:
        value = stack.pop()
        items = value.values() if isinstance(value, dict) else value
        n += len(value)
        stack.extend(v for v in items if isinstance(v, (list, dict)))
    return n


def _counted(path: Path, where: str, row: dict, before: int) -> int:
    """`before` plus the row's values; RolloutError when the row, or the file so far, passes its bound."""
    n = row_values(row)
    if n > MAX_ROW_VALUES:
        _over_row(path, where, f"{n} values")
    if before + n > MAX_VALUES:
        raise RolloutError(f"{path} holds over {MAX_VALUES} values (token ids and logprobs, counted to {where}), the "
                           f"bound on a rollout file; {SPLIT}")
    return before + n


def _over_row(path: Path, where: str, held: str) -> None:
    raise RolloutError(f"{path} {where} holds {held}, over the {MAX_ROW_VALUES} values of one rollout row (a "
                       "response longer than any model's context); it is not a rollout row: pass the file your RL run "
                       "wrote")


def _out_of_memory(path: Path, where: str) -> RolloutError:
    return RolloutError(f"out of memory reading {path} at {where}: this process may not take the memory its rows "
                        f"need (docs/reference/errors.md: what each bound costs); raise its memory limit or split the file "
                        "(one RL step per file)")


def _parquet(path: Path, data: bytes) -> list[dict]:
    """The rows, read a record batch at a time after the metadata's row and value counts are checked: a few kB of
    run-length-encoded Parquet can declare a billion values, which would otherwise be decoded before any check.
    Strings are read as dictionaries and their decoded bytes counted before they are expanded: a dictionary page
    can repeat one long string for every row at a few bits each."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise RolloutError("reading Parquet needs pyarrow, which is not installed: `pip install pyarrow`, or "
                           "convert the file to JSONL") from e
    where = "its metadata"
    try:
        meta = pq.ParquetFile(io.BytesIO(data)).metadata
        if meta.num_rows > MAX_ROWS:
            raise RolloutError(f"{path} holds {meta.num_rows} rows, over the {MAX_ROWS} of a rollout file; {SPLIT}")
        chunks = [meta.row_group(g).column(c) for g in range(meta.num_row_groups)
                  for c in range(meta.num_columns)]
        values = sum(chunk.num_values for chunk in chunks)
        expanded = sum(chunk.total_uncompressed_size for chunk in chunks)
        if values > MAX_VALUES or expanded > MAX_BYTES:
            raise RolloutError(f"{path} declares {values} values ({expanded / 2**30:.1f} GiB decoded), over the "
                               f"{MAX_VALUES} values or {MAX_BYTES // 2**30} GiB of a rollout file; {SPLIT}")
        strings = sorted({meta.schema.column(c).path for c in range(meta.num_columns)
                          if meta.schema.column(c).physical_type in ("BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY")})
        file = pq.ParquetFile(io.BytesIO(data), read_dictionary=strings or None)
        rows, values, decoded = [], 0, 0
        for batch in file.iter_batches(batch_size=64):
            decoded += sum(_expanded_bytes(column) for column in batch.columns)
            if decoded > MAX_BYTES:
                raise RolloutError(f"{path} holds over {MAX_BYTES // 2**30} GiB once its strings are decoded (to row "
                                   f"{len(rows) + batch.num_rows}), the bound on a rollout file; {SPLIT}")
            for row in batch.to_pylist():
                where = f"row {len(rows)}"
                values = _counted(path, where, row, values)
                rows.append(row)
        return rows
    except RolloutError:
        raise
    except MemoryError:
        raise _out_of_memory(path, where) from None
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for every unreadable file
        if "memory" in str(e).lower():  # arrow's own allocation failure (ArrowMemoryError, std::bad_alloc)
            raise _out_of_memory(path, where) from None
        raise RolloutError(f"cannot read {path} as Parquet ({one_line(e, 160)}); it is cut short or not a "
                           "Parquet file") from e


def _expanded_bytes(column) -> int:
    """The bytes a column's strings take once every dictionary index is replaced by its string (0 without a
    dictionary: what the batch holds is already counted by the metadata's decoded size)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    while pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        column = pc.list_flatten(column)
    if isinstance(column, pa.ChunkedArray):
        return sum(_expanded_bytes(chunk) for chunk in column.chunks)
    if pa.types.is_struct(column.type):
        return sum(_expanded_bytes(column.field(i)) for i in range(column.type.num_fields))
    if not pa.types.is_dictionary(column.type):
        return 0
    lengths = pc.binary_length(column.dictionary).take(column.indices.drop_null())
    return int(pc.sum(lengths).as_py() or 0)
