"""A whole RL run's mismatch, step by step, from the rollout files it wrote: `score` over a folder or a glob, one
file per step. With both logprob columns in the files (rollouts/columns.py) no model loads, so a 235B run is read on
any machine; with --model the training stack (and --infer vllm's prefill) scores each step as `score` does.

Writes steps.csv (one row per step: score's summary columns, generate mode's RL metrics among them), alarms.csv
(per alarm: the first step at which the metric rose past its threshold) and steps.png/.pdf (each alarm's metric
against step, its threshold and first crossing marked, the reward beside it when the files record one). Files are
read and scored one at a time and each step's row goes to disk as it is made: memory does not grow with the steps.

Published collapses of RL runs (the training–inference mismatch reports of 2025) were preceded by a rising k3 KL
and a growing tail of tokens whose two probabilities differ by more than a factor of two, before the reward fell:
DEFAULT_ALARMS watch those two.
"""

from __future__ import annotations

import contextlib
import glob
import math
from array import array
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from .manifest import build_manifest, runnable_command
from .progress import Progress, phase
from ..errors import OutputError, ProbeError
from ..reports.gate import Condition, Gate, GateWatch, Verdict, measured
from ..rollouts.record import RolloutBatch, RolloutError
from ..rollouts.read import JSONL, PARQUET
from ..rundir import MANIFEST, atomic_dir, file_sha256, locked, open_to_write, rescue, write_csv, write_json

# Starting points, not verdicts: k3 (the KL(π_infer‖π_train) estimate a trainer sees) past 1e-3 nats per token, and
# more than one token in a thousand whose probability differs by over 2x between the two stacks. Set your own with
# --alarm METRIC>VALUE (any steps.csv metric) once a healthy run has shown you its own level.
DEFAULT_ALARMS = ("k3>1e-3", "frac_abs_dlogp_over_ln2>1e-3")
STEPS, ALARMS = "steps.csv", "alarms.csv"
# draws the history's figures into a folder holding steps.csv, from the alarms; returns the file names it wrote
# (reports/steps.py: the presentation layer, which this module does not import)
Draw = Callable[[Path, list], list[str]]


def step_files(paths) -> list[Path]:
    """The rollout files of a run, in step order: each path is a file, a folder (its rollout files, in natural
    order: step_2 before step_10) or a glob a shell did not expand. One line when none is found."""
    found: list[Path] = []
    for path in paths:
        text = str(path)
        if any(c in text for c in "*?[") and not Path(text).exists():
            matches = [Path(m) for m in glob.glob(text)]
            if not matches:
                raise RolloutError(f"{text} matches no file; pass a folder of rollout files, a glob or the files")
            found += sorted((m for m in matches if m.is_file()), key=_natural)
        elif Path(text).is_dir():
            inside = [p for p in Path(text).iterdir() if p.is_file() and p.name.lower().endswith((*JSONL, *PARQUET))]
            if not inside:
                raise RolloutError(f"folder {text} holds no rollout files (.jsonl, .jsonl.gz, .parquet); pass the "
                                   "folder your RL run dumped its steps to")
            found += sorted(inside, key=_natural)
        else:
            found.append(Path(text))
    if len(set(found)) != len(found):
        raise RolloutError("a rollout file is named twice among the paths; pass each step once")
    return found


def _natural(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def parse_alarms(texts) -> Gate:
    """--alarm METRIC>VALUE (default DEFAULT_ALARMS), checked as --fail-if is: a metric steps.csv can hold."""
    alarms = Gate.parse(texts or DEFAULT_ALARMS, "history", "--alarm")
    for c in alarms.conditions:
        if c.op not in (">", ">="):
            raise ProbeError(f"--alarm {c.text!r}: an alarm fires where a metric rises past a threshold; write "
                             f"{c.metric}>VALUE")
    return alarms


@dataclass
class Alarm:
    """One alarm as the steps stream by: the first step where its metric rose past the threshold."""

    condition: Condition
    first_step: int | None = None
    value: float | None = None

    def see(self, step: int, summary: dict) -> None:
        """The least step it holds at, whatever order the steps come in."""
        earlier = self.first_step is None or step < self.first_step
        if earlier and measured(summary, self.condition.metric) is not None:
            holds, value = self.condition.check(summary)
            if holds:
                self.first_step, self.value = step, value

    def row(self) -> dict:
        c = self.condition
        return {"metric": c.metric, "op": c.op, "threshold": c.value, "fired": self.first_step is not None,
                "first_step": self.first_step, "value": self.value}


@dataclass
class History:
    """What a history run wrote, for the CLI's table and exit code."""

    out_dir: Path
    n_steps: int
    alarms: list[Alarm]
    verdict: Verdict | None
    last: dict = field(default_factory=dict)  # the last step's row


def step_row(step: int, batch: RolloutBatch, summary: dict) -> dict:
    """steps.csv's row of one step: where it came from, its reward when recorded, score's summary."""
    rewards = [r.reward for r in batch.rollouts if r.reward is not None]
    return {"step": step, "file": batch.path.name, "sha256": batch.sha256, "n_rollouts": len(batch.rollouts),
            "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan, **summary}


class _Steps:
    """The steps as they are scored, each row written to steps.csv and flushed at once: the file holds whole rows
    (what a rescue copies), and memory does not grow with the steps. `into` points the rows at another file (a
    rescue folder's) after a write error, carrying the rows written so far; the scoring goes on from the next file."""

    def __init__(self, files: list[Path], score_one, watching: list[Alarm], watch: GateWatch | None,
                 progress: Progress | None) -> None:
        self.files, self.score_one, self.watching, self.watch, self.progress = files, score_one, watching, watch, progress
        self.done, self.seen, self.last = 0, set(), {}
        self.from_field: Path | None = None  # the first file that records its step, and the first that does not
        self.from_order: Path | None = None
        self.spans = array("q")  # step, offset, length of each row in steps.csv as written: 24 bytes a step
        self.in_step_order: bool | None = None  # whether the files came in step order (known once sorted)
        self.columns: list[str] | None = None
        self.file, self.path, self.good, self.pending = None, None, 0, b""  # pending: a scored row not yet on disk

    def into(self, path: Path) -> None:
        previous, good = self.path, self.good
        self.close()
        self.file, self.path, self.good = open_to_write(path, "wb"), path, 0
        if previous is not None:
            with previous.open("rb") as f:
                while self.good < good:
                    chunk = f.read(min(1 << 20, good - self.good))
                    self.file.write(chunk)
                    self.good += len(chunk)
        self._put(b"")

    def _put(self, text: bytes) -> None:
        self.pending += text
        self.file.write(self.pending)
        self.file.flush()
        self.good += len(self.pending)
        self.pending = b""

    def score(self) -> None:
        while self.done < len(self.files):
            path = self.files[self.done]
            batch, summary = self.score_one(path)
            step = self.done if batch.step is None else batch.step
            if batch.step is None:
                self.from_order = self.from_order or path
            else:
                self.from_field = self.from_field or path
            if self.from_field is not None and self.from_order is not None:
                raise RolloutError(f"{self.from_field} records its step (a `step` field) and {self.from_order} does "
                                   "not, so their step numbers would mix two orders; give every file's rows their "
                                   "step, or none (the file order numbers the steps)")
            if step in self.seen:
                raise RolloutError(f"{path} is step {step} again (its `step` field); pass each step's file once")
            self.seen.add(step)
            row = step_row(step, batch, summary)
            frame = pd.DataFrame([row])
            if self.columns is None:
                self.columns = list(frame.columns)
            text = frame.reindex(columns=self.columns).to_csv(header=self.done == 0, index=False, lineterminator="\n")
            head = b""  # the header, before the first row: a row's span is its own bytes
            if self.done == 0:
                header, _, text = text.partition("\n")
                head = f"{header}\n".encode("utf-8")
            for alarm in self.watching:
                alarm.see(step, row)
            if self.watch is not None:
                self.watch.see(f"step {step}", row, order=step)
            if not self.last or step > self.last["step"]:
                self.last = row
            self.done += 1
            data = text.encode("utf-8")
            self.spans.extend((step, self.good + len(self.pending) + len(head), len(data)))
            self._put(head + data)
            if self.progress is not None:
                self.progress(self.done, len(self.files))
        self.close()

    def sort(self) -> None:
        """Rewrite steps.csv with its rows in step order: each row copied from where it was written, one at a time,
        so the rows never sit in memory together. The spans then describe the sorted file (a rescue after this copies
        it as it is, and sorting it again changes nothing)."""
        rows = np.frombuffer(self.spans, dtype=np.int64).reshape(-1, 3)
        in_order = bool((np.diff(rows[:, 0]) > 0).all())
        if self.in_step_order is None:
            self.in_step_order = in_order
        if in_order:
            return
        path = self.path
        ordered = rows[np.argsort(rows[:, 0], kind="stable")]
        sorted_path = path.with_name(path.name + ".sorted")
        with path.open("rb") as source, open_to_write(sorted_path, "wb") as out:
            out.write(source.read(int(rows[0, 1])))  # the header
            for offset, length in ordered[:, 1:]:
                source.seek(int(offset))
                out.write(source.read(int(length)))
        sorted_path.replace(path)
        offsets = int(rows[0, 1]) + np.concatenate([[0], np.cumsum(ordered[:-1, 2])])
        spans = np.column_stack([ordered[:, 0], offsets, ordered[:, 2]]).astype(np.int64)
        self.spans = array("q", spans.tobytes())

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):  # a failed write's buffer: its rows are in `pending`
                self.file.close()
            self.file = None


def write_history(files: list[Path], out_dir: Path, score_one, *, alarms: Gate, gate: Gate | None = None,
                  manifest: dict | None = None, draw: Draw | None = None,
                  progress: Progress | None = None) -> History:
    """Score every file (`score_one(batch_path) -> (batch, summary)`) in order and write the history folder: all or
    nothing (atomic_dir), the manifest last; `draw` adds the figures. Steps are the files' `step` fields, else
    their order (0, 1, ...).

    A history is read in step order, whatever order its files come in (names that do not sort by step: hashes,
    timestamps, a glob's order): steps.csv is written in step order, an alarm's first crossing and a gate's failure
    are at the least step where they hold, and the figure runs left to right. Rows still stream to disk as they are
    made (only each row's step and place in the file are kept), so memory stays flat. A step named twice, or files
    of which some record a `step` field and others do not (their numbers would mix two orders), are one line.

    A write error (a full disk, a file-size limit) is an OutputError naming the file and
    the OS error; the steps written so far and the rest go to a rescue folder in the temp folder (rundir.rescue)
    if possible, and the message says where."""
    watching = [Alarm(c) for c in alarms.conditions]
    watch = GateWatch(gate) if gate else None
    steps = _Steps(files, score_one, watching, watch, progress)
    out_dir = Path(out_dir)
    rescued: tuple[Path | None, str | None] = (None, None)
    with locked(out_dir):
        try:
            with atomic_dir(out_dir) as tmp:
                phase(progress, "scoring the steps")
                try:
                    _write(tmp, steps, manifest, draw)
                except OSError:  # while tmp still holds the rows written so far
                    rescued = rescue(out_dir, lambda folder: _write(folder, steps, manifest, draw))  # the rest too
                    raise
        except OSError as e:
            name = e.run_file if isinstance(getattr(e, "run_file", None), str) else None
            where = out_dir / name if name else out_dir
            saved_to, why = rescued
            saved = (f"the results were saved to {saved_to} instead (move that folder where you want it)" if saved_to
                     else f"the results could not be saved elsewhere either ({why})")
            raise OutputError(f"cannot write {where} ({e.strerror or e}); {saved}; free space there or choose "
                              "another --out and rerun") from e
        finally:
            steps.close()
    return History(out_dir, len(files), watching, watch.verdict if watch is not None else None, steps.last)


def _write(folder: Path, steps: _Steps, manifest: dict | None, draw: Draw | None) -> None:
    """steps.csv (the scoring streams into it), alarms.csv, the figures and the manifest, into `folder`. An OSError
    leaves with `run_file`, the name of the file being written (None: a figure)."""
    name: str | None = STEPS
    try:
        steps.into(folder / STEPS)
        steps.score()
        steps.sort()
        name = ALARMS
        write_csv(pd.DataFrame([a.row() for a in steps.watching]), folder / ALARMS)
        name = None  # one of the figures, which draw names
        figures = draw(folder, steps.watching) if draw is not None else []
        name = MANIFEST
        record = build_manifest("history", manifest or {}, {"history": {
            "n_steps": len(steps.files), "alarms": [a.row() for a in steps.watching],
            "steps_from": "the rows' step field" if steps.from_field else "the file order",
            "files_in_step_order": steps.in_step_order}}, command=runnable_command())
        if steps.watch is not None:
            record["gate"] = steps.watch.verdict.record()
        record["files"] = {n: {"rows": _rows(folder / n), "sha256": file_sha256(folder / n)}
                           for n in (STEPS, ALARMS, *figures)}
        write_json(record, folder / MANIFEST)
    except OSError as e:
        e.run_file = name
        raise


def _rows(path: Path) -> int:
    if not path.name.endswith(".csv"):
        return 0
    with path.open("rb") as f:
        return max(sum(1 for _ in f) - 1, 0)
