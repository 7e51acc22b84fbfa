"""The run folder format: --out checks and lock, the marker of the tool's own output folders, atomic write_run
(rows + sha256 per file). run_folder.py reads a run folder back, checked."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gzip
import hashlib
import json
import os
import secrets
import shutil
import stat
import tempfile
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator

import pandas as pd

from .errors import OutputError, ProbeError

MANIFEST = "manifest.json"
PROMPTS = "prompts.jsonl"
# generate mode's samples as rollouts `score` reads back (checked by sha256 and line count like any listed file)
ROLLOUTS = "rollouts.jsonl"
KINDS = ("compare", "ablate", "remedies")
WRITTEN_KINDS = (*KINDS, "score")  # run folders write_run makes; score (runs/score.py) has no RunSpec kind
# Files a run folder may hold, with the columns a reader relies on. tokens.csv may be gzipped (tokens.csv.gz)
# or deleted to save space; every other file listed in the manifest must be there.
COLUMNS = {
    "summary.csv": (),
    "layers.csv": ("layer", "tap", "rel_l2"),
    "tokens.csv": ("prompt_id", "position", "logprob_infer", "delta_logprob", "kl"),
    "ablation.csv": ("combo",),
    "attribution.csv": ("region",),  # older folders: `shapley`, `share` (reports/load.py reads both)
    "buckets.csv": (),
    "batch_invariance.csv": (),
    "kernel_noise.csv": (),
    "local.csv": ("layer", "tap", "family", "local_rel_l2", "propagated_rel_l2"),
    "local_families.csv": ("family", "local_rel_l2"),
    "local_routing.csv": ("layer", "frac_topk_set_differs"),
    "depth.csv": ("layer", "mean_abs_dlogp", "mean_kl"),
    "engine_noise.csv": (),
    "routing.csv": ("layer", "frac_topk_set_differs"),
    "routing_noise.csv": ("side", "layer", "frac_topk_set_differs"),
    "reference_local.csv": ("layer", "tap", "ref_err_infer", "ref_err_train"),  # --reference's local reading
    "remedies.csv": ("arm", "needs", "status", "reason"),
}
RERUN = "rerun the command that made the run folder"
MARK = ".divergence-probe"  # in every output folder the tool makes: which output it is, and the files it wrote
TOOL = "divergence-probe"
MANIFEST_LIMIT = 16 * 2**20  # a manifest is a few kB; a larger one is not one the tool wrote, and is not read whole


class RunFolderError(ProbeError):
    """A run folder to read is missing, is not a run folder, or has cut, changed or unreadable files."""


# ---------------------------------------------------------------------------------------------- marker
def _files(folder: Path) -> list[str]:
    """Every file under folder (relative, POSIX), links and special files included, the marker excluded."""
    found = []
    for root, dirs, files in os.walk(folder):  # followlinks=False: a linked folder is one entry, not its content
        for name in dirs + files:
            path = Path(root) / name
            if name in files or path.is_symlink():
                found.append(path.relative_to(folder).as_posix())
    return sorted(f for f in found if f != MARK)


def mark(folder: Path, output: str) -> None:
    """Record in `folder` that the tool made it as `output` (report, model, rl) and which files it holds, so that
    a later writer may replace it (`marked`): a folder without the mark, or with files the tool did not write, is
    never the tool's to delete. The content depends on nothing but the files, so outputs stay byte-identical.
    compare/ablate run folders carry none: they are never replaced (check_out_dir without `replaces`), and their
    manifest already lists their files."""
    record = {"tool": TOOL, "output": output, "files": _files(Path(folder))}
    with open_to_write(Path(folder) / MARK, "w") as f:
        f.write(json.dumps(record, indent=1, sort_keys=True) + "\n")


def marked(folder: Path, output: str) -> bool:
    """Whether folder is an output of kind `output` that the tool made and nobody added to since: its mark says
    so, and every file in it (no links, no special files) is one the mark lists."""
    folder = Path(folder)
    marker = folder / MARK
    if folder.is_symlink() or marker.is_symlink() or not marker.is_file():
        return False
    try:
        with marker.open("rb") as f:
            data = f.read(MANIFEST_LIMIT + 1)
        record = json.loads(data)
    except (OSError, ValueError, RecursionError):
        return False
    if len(data) > MANIFEST_LIMIT or not isinstance(record, dict) or record.get("tool") != TOOL \
            or record.get("output") != output or not isinstance(record.get("files"), list):
        return False
    listed = set(record["files"])
    return all(name in listed and not (folder / name).is_symlink() and (folder / name).is_file()
               for name in _files(folder))


# ---------------------------------------------------------------------------------------------- --out
def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and not path.is_symlink() and path != path.parent:
        path = path.parent
    return path


def _missing_folders(folder: Path) -> list[Path]:
    """folder and those of its ancestors that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _make_parent(out_dir: Path) -> Path:
    """Create out_dir's parent folders; OutputError naming the real obstacle when that is impossible."""
    parent = out_dir.absolute().parent
    existing = _nearest_existing(parent)
    if existing.exists() and not existing.is_dir():
        raise OutputError(f"cannot write --out {out_dir}: {existing} is a file, not a folder; choose another "
                          "--out (or move that file away)")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {parent} ({e.strerror}); choose a writable --out") from e
    return parent


def refuse_link(out_dir: Path) -> None:
    """An output folder is never reached through a link: the tool writes, renames and removes in the folder --out
    names, and a link (planted, or to a folder elsewhere) would move all of that to another place, or make the
    final rename fail after the whole run."""
    if Path(out_dir).is_symlink():
        raise OutputError(f"--out {out_dir} is a link (to {os.readlink(out_dir)}); {TOOL} writes only into the folder "
                          "--out names: pass the folder itself, or another --out")


def check_out_dir(out_dir: Path, replaces: str | None = None) -> None:
    """Fail before any expensive work if out_dir cannot become the output folder: it must be new or empty
    (or, with `replaces`, an output of that kind the tool marked and nobody added to, see `marked`), not a
    mount point (the folder is renamed into place), and its parent writable."""
    out_dir = Path(out_dir)
    refuse_link(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"--out {out_dir} is a file, not a folder; choose another --out or remove the file")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (replaces and marked(out_dir, replaces)):
        if replaces:
            raise OutputError(f"--out {out_dir} already exists and holds files other than a previous {replaces} of "
                              f"{TOOL}; choose another --out or remove it")
        raise OutputError(f"--out {out_dir} already exists and is not empty; choose another --out or remove it")
    if out_dir.is_dir() and os.path.ismount(out_dir):
        raise OutputError(f"--out {out_dir} is a mount point: the output is written beside it and renamed into "
                          f"place, which a mount point cannot take; choose a folder inside it, e.g. {out_dir / 'run'}")
    parent = _make_parent(out_dir)
    try:
        probe = tempfile.mkdtemp(prefix=f".{out_dir.name}.check-", dir=parent)
        os.rmdir(probe)
    except OSError as e:
        raise OutputError(f"cannot write to {parent} ({e.strerror}); choose a writable --out") from e


def default_out_dir(base: Path = Path("runs")) -> Path:
    """runs/<date>-<time>-<microseconds>: two runs started in the same second get different folders; a name
    that is taken (or claimed by a running run) gets a -2, -3, ... suffix."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    candidate, n = base / stamp, 1
    while candidate.exists() or candidate.is_symlink() or os.path.lexists(_lock_path(candidate)):
        n += 1
        candidate = base / f"{stamp}-{n}"
    return candidate


# ---------------------------------------------------------------------------------------------- lock
_HELD: dict[Path, int] = {}  # lock file -> descriptor, for the claims this process holds


def _lock_path(out_dir: Path) -> Path:
    out_dir = Path(out_dir).absolute()
    return Path(os.path.realpath(out_dir.parent)) / f".{out_dir.name}.lock"  # one key however it is spelled


def _open_lock(lock: Path) -> int:
    """The lock file's descriptor, opened without following a link: a link planted at the lock's name (in a shared
    run folder, say) would otherwise have the pid written into, or a new file created at, whatever it points to.
    A file with other names (hard links) or that is not a plain file is refused too: it is someone else's."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OutputError(f"the lock file {lock} is a link (to {os.readlink(lock)}), which {TOOL} never opens; "
                              "remove the link, or choose another --out") from None
        raise OutputError(f"cannot create the lock file {lock} ({e.strerror}); choose a writable --out") from e
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        raise OutputError(f"the lock file {lock} is not a plain file of its own (a hard link, a pipe or a device), "
                          f"which {TOOL} never writes; remove it, or choose another --out")
    return fd


@contextmanager
def locked(out_dir: Path) -> Iterator[Path]:
    """Hold an exclusive lock on out_dir (a hidden sibling `.NAME.lock`) until the block ends; a second
    process aiming at the same folder gets an OutputError at once. Re-entrant within one process."""
    out_dir = Path(out_dir)
    lock = _lock_path(out_dir)
    if lock in _HELD:
        yield out_dir
        return
    created = _missing_folders(out_dir.absolute().parent)  # made for this run: removed again if it writes nothing
    _make_parent(out_dir)
    while True:
        fd = _open_lock(lock)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputError(f"cannot lock {lock} ({e.strerror}); choose another --out") from e
            raise OutputError(f"--out {out_dir} is being written by another run (process {holder}, lock {lock}); "
                              "wait for it to finish or choose another --out") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed this lock file as we opened it: take the new one
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError:
        pass  # the pid is only for the message of a competing run
    _HELD[lock] = fd
    try:
        yield out_dir
    finally:
        del _HELD[lock]
        try:
            lock.unlink()  # while still locked, so no one can hold a lock on a file that is gone
        except OSError:
            pass
        os.close(fd)
        if not out_dir.exists():
            for folder in created:  # deepest first; a folder something else wrote into meanwhile stays
                with contextlib.suppress(OSError):
                    folder.rmdir()


@contextmanager
def output_folder(out_dir: Path, output: str, replaces: str | None = None) -> Iterator[Path]:
    """Write one output folder of kind `output` (a report): lock --out, write into a hidden sibling (atomic_dir),
    mark it, rename it into place. An OSError (a full disk, a read-only place) is one OutputError."""
    out_dir = Path(out_dir)
    with locked(out_dir):
        try:
            with atomic_dir(out_dir, replaces) as tmp:
                yield tmp
                mark(tmp, output)
        except OSError as e:
            raise OutputError(f"cannot write {out_dir} ({e.strerror or e}); free space there or choose another "
                              "--out") from e


@contextmanager
def claim_out_dir(out_dir: Path) -> Iterator[Path]:
    """Take --out for this run at its start: lock it, then check it is new or empty and writable. Hold the
    claim until the run is written (write_run inside the block reuses it)."""
    with locked(out_dir):
        check_out_dir(Path(out_dir))
        yield Path(out_dir)


# ---------------------------------------------------------------------------------------------- atomic folder
def _new_dir(parent: Path, prefix: str, ours: list[Path]) -> Path:
    """A new folder with the mode the umask gives (mkdtemp's 0700 would hide a shared output from its readers).
    Its path is in `ours` from just before it is made: a signal raised the moment mkdir returns (a stop lands at the
    first bytecode after a system call) still finds it there to remove."""
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        ours[:] = [path]
        try:
            path.mkdir()
            return path
        except FileExistsError:  # another's folder of that name: not ours to remove
            ours.clear()
            continue


@contextmanager
def atomic_dir(out_dir: Path, replaces: str | None = None) -> Iterator[Path]:
    """Yield a hidden temporary sibling folder; when the block succeeds it becomes out_dir, when it fails
    (any exception, KeyboardInterrupt and SystemExit included) it is removed. With `replaces`, an existing
    output of that kind the tool marked is swapped out only after the new one is complete (and only if it is
    still untouched then)."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, replaces)
    parent = out_dir.absolute().parent
    ours: list[Path] = []
    try:
        tmp = _new_dir(parent, f".{out_dir.name}.partial-", ours)
        yield tmp
        if out_dir.is_dir() and any(out_dir.iterdir()):
            if not (replaces and marked(out_dir, replaces)):  # files were added while the new one was made
                raise OutputError(f"{out_dir} changed while the new {replaces or 'output'} was written (it holds files "
                                  f"{TOOL} did not write); choose another --out or remove it")
            holder = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=parent))
            os.rename(out_dir, holder / out_dir.name)
            try:
                os.rename(tmp, out_dir)
            except BaseException:
                os.rename(holder / out_dir.name, out_dir)  # put the previous folder back
                shutil.rmtree(holder, ignore_errors=True)
                raise
            shutil.rmtree(holder, ignore_errors=True)
        else:
            if out_dir.exists():
                out_dir.rmdir()  # empty, checked above
            tmp.rename(out_dir)
    except BaseException:
        for path in ours:
            shutil.rmtree(path, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------- writing
def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks (run files and rollout files can be large)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def open_to_write(path: Path, mode: str):
    """path opened for writing (mode "w" or "wb"), never through a link: the output files of the tool are made in
    folders it just made, and a link found there was planted to redirect the write elsewhere (OSError ELOOP)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8", "newline": ""}))


def write_csv(df: pd.DataFrame, path: Path) -> None:
    # Shortest round-trip float repr and "\n" line ends: same numbers, same bytes, on every platform.
    # A .gz name is gzipped without a timestamp, so the bytes stay reproducible.
    with open_to_write(path, "wb") as f:
        if path.name.endswith(".gz"):
            with gzip.GzipFile(filename=path.name, mode="wb", fileobj=f, mtime=0) as packed:
                df.to_csv(packed, index=False, lineterminator="\n")
        else:
            df.to_csv(f, index=False, lineterminator="\n")


def write_jsonl(df: pd.DataFrame, path: Path) -> None:
    """One JSON object per row (list cells stay lists): generate mode's rollouts.jsonl, in a layout `score` reads."""
    with path.open("w", encoding="utf-8") as f:
        for record in df.to_dict("records"):
            f.write(json.dumps(record) + "\n")


def write_json(obj, path: Path) -> None:
    with open_to_write(path, "w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, default=str) + "\n")


def write_prompts(prompts, path: Path) -> None:
    with open_to_write(path, "w") as f:
        for p in prompts:
            record = {"prompt_id": p.prompt_id, "source": p.source, "text": p.text,
                      "token_ids": list(p.token_ids), "truncated": p.truncated}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def _write_files(folder: Path, manifest: dict, prompts, tables: dict[str, pd.DataFrame]) -> None:
    """Every file of a run, the manifest last (it records the others). An OSError leaves with `run_file`, the
    name of the file being written, so the message can name it under --out rather than the temporary folder."""
    steps = [(PROMPTS, lambda path: write_prompts(prompts, path), len(prompts))]
    steps += [(name, lambda path, df=df, write=write_jsonl if name.endswith(".jsonl") else write_csv: write(df, path),
               len(df)) for name, df in tables.items()]
    files = {}
    for name, write, rows in steps + [(MANIFEST, None, None)]:
        try:
            if write is None:
                write_json({**manifest, "files": files}, folder / MANIFEST)
            else:
                write(folder / name)
                files[name] = {"rows": rows, "sha256": file_sha256(folder / name)}
        except OSError as e:
            e.run_file = name
            raise


def rescue_dir(out_dir: Path) -> Path:
    """Where the results of a run that could not be written to `out_dir` go instead: a new folder in the temp folder."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path(tempfile.gettempdir()) / f"divergence-probe-rescue-{Path(out_dir).name}-{stamp}-{os.getpid()}"


def rescue(out_dir: Path, write: Callable[[Path], None]) -> tuple[Path | None, str | None]:
    """`write(folder)` into a new rescue folder (rescue_dir), all or nothing: (where, None), or (None, why not)."""
    where = rescue_dir(out_dir)
    try:
        with atomic_dir(where) as tmp:
            write(tmp)
    except (OSError, ProbeError) as e:
        return None, getattr(e, "strerror", None) or str(e)
    return where, None


def _rescue(out_dir: Path, manifest: dict, prompts, tables) -> tuple[Path | None, str | None]:
    """Write the run into the temp folder instead; (where, None) or (None, why not)."""
    return rescue(out_dir, lambda folder: _write_files(folder, manifest, prompts, tables))


def write_run(out_dir: str | Path, manifest: dict, prompts, tables: dict[str, pd.DataFrame]) -> Path:
    """Write a run folder: manifest.json (with a `files` section: rows and sha256 of every data file),
    prompts.jsonl and each table (file name -> frame). All or nothing: the folder appears only when complete.
    A write error (a full disk) is an OutputError naming the file and the OS error; the results are then
    written to a rescue folder in the temp folder if possible, and the message says where."""
    if manifest.get("kind") not in WRITTEN_KINDS:
        raise ValueError(f"manifest['kind'] is {manifest.get('kind')!r}; the caller must set one of {WRITTEN_KINDS}")
    unknown = [n for n in tables if n.removesuffix(".gz") not in COLUMNS and n != ROLLOUTS]
    if unknown:
        raise ValueError(f"unknown run files {unknown}; add them to rundir.COLUMNS")
    out_dir = Path(out_dir)
    with locked(out_dir):
        try:
            with atomic_dir(out_dir) as tmp:
                _write_files(tmp, manifest, prompts, tables)
        except OSError as e:
            where = out_dir / e.run_file if getattr(e, "run_file", None) else out_dir
            problem = e.strerror or str(e)
            rescue, why = _rescue(out_dir, manifest, prompts, tables)
            saved = (f"the results were saved to {rescue} instead (move that folder where you want it)" if rescue
                     else f"the results could not be saved elsewhere either ({why})")
            raise OutputError(f"cannot write {where} ({problem}); {saved}; free space there or choose another "
                              "--out and rerun") from e
    return out_dir
