"""The rl run folder: rl.csv appended and flushed one row per step (a killed run keeps its rows), then
rl_summary.csv and manifest.json written last, each atomically (temp file + rename), with rows and sha256 of every file.

A folder without manifest.json is a run that did not finish: its rl.csv holds every completed step. A write that
fails (a full disk) stops the run; its rows go to a rescue folder in the temp folder instead (`rescue`), as compare's
results do (rundir.write_run).
"""

from __future__ import annotations

import csv
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pandas as pd

from ..rundir import MANIFEST, check_out_dir, file_sha256, locked, mark, open_to_write, write_csv, write_json
from ..rundir import rescue as rescue_into

ROWS = "rl.csv"
SUMMARY = "rl_summary.csv"
class RLWriter:
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.columns: list[str] | None = None
        self.rows = 0
        self._file = None
        self._csv = None
        self._broken = False  # a write to rl.csv failed: its buffer can never be flushed

    def add(self, row: dict) -> None:
        """Append one step's row and flush it to the OS."""
        try:
            if self._file is None:
                self.columns = list(row)
                self._file = open_to_write(self.out_dir / ROWS, "w")
                self._csv = csv.DictWriter(self._file, self.columns, lineterminator="\n")
                self._csv.writeheader()
            self._csv.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})
            self._file.flush()
        except OSError:
            self._broken = True
            raise
        self.rows += 1

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                if not self._broken:  # after a failed write, closing fails on the same buffer: already reported
                    raise

    def discard(self) -> None:
        """Remove what was written (the rows went to a rescue folder instead); the claimed folder is then empty."""
        self._broken = True
        self.close()
        for name in (ROWS, SUMMARY):
            (self.out_dir / name).unlink(missing_ok=True)
        self.rows = 0

    def _atomic(self, name: str, write) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=self.out_dir)
        os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the summary and manifest; rl.csv has this mode
        try:
            write(Path(tmp))
            os.replace(tmp, self.out_dir / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def finish(self, manifest: dict, summary: pd.DataFrame) -> None:
        """rl_summary.csv, then the manifest that lists every file (rows, sha256): the run is complete."""
        self.close()
        self._atomic(SUMMARY, lambda p: write_csv(summary, p))
        files = {ROWS: {"rows": self.rows, "sha256": file_sha256(self.out_dir / ROWS)},
                 SUMMARY: {"rows": len(summary), "sha256": file_sha256(self.out_dir / SUMMARY)}}
        self._atomic(MANIFEST, lambda p: write_json({**manifest, "files": files}, p))


@contextmanager
def rl_folder(out_dir: Path) -> Iterator[RLWriter]:
    """Claim --out (lock; new or empty), create it, mark it as the tool's (rundir.mark) and yield the writer; rows
    stay on disk if the run fails."""
    out_dir = Path(out_dir)
    with locked(out_dir):
        check_out_dir(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        writer = RLWriter(out_dir)
        try:
            mark(out_dir, "rl")  # inside the try: a full disk here must not leave the new folder behind
            yield writer
        except BaseException:
            writer.close()
            if writer.rows == 0:  # failed before its first step: leave nothing behind
                shutil.rmtree(out_dir, ignore_errors=True)
            raise
        finally:
            writer.close()


def rescue(out_dir: Path, rows: list[dict], finished: tuple[dict, pd.DataFrame] | None) -> tuple[Path | None, str | None]:
    """The rows (and, for a run that finished, its summary and manifest) written to a new folder in the temp folder,
    when --out could not take them (a full disk): (where, None), or (None, why not)."""
    def write(folder: Path) -> None:
        writer = RLWriter(folder)
        for row in rows:
            writer.add(row)
        writer.close()
        if finished is not None:
            writer.finish(*finished)
        mark(folder, "rl")

    return rescue_into(out_dir, write)
