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

import glob
import math
from array import array
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from .manifest import build_manifest
from .progress import Progress, phase
from ..errors import ProbeError
from ..reports.gate import Condition, Gate, GateWatch, Verdict, measured
from ..rollouts import RolloutBatch, RolloutError
from ..rollouts.read import JSONL, PARQUET
from ..rundir import MANIFEST, atomic_dir, file_sha256, locked, write_csv, write_json

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
    of which some record a `step` field and others do not (their numbers would mix two orders), are one line."""
    watching = [Alarm(c) for c in alarms.conditions]
    watch = GateWatch(gate) if gate else None
    columns: list[str] | None = None
    seen: set[int] = set()
    spans = array("q")  # step, offset, length of each row in steps.csv as written: 24 bytes a step
    from_field: Path | None = None
    from_order: Path | None = None
    last: dict = {}
    with locked(out_dir), atomic_dir(out_dir) as tmp:
        phase(progress, "scoring the steps")
        with (tmp / STEPS).open("wb") as f:
            for n, path in enumerate(files):
                batch, summary = score_one(path)
                step = n if batch.step is None else batch.step
                if batch.step is None:
                    from_order = from_order or path
                else:
                    from_field = from_field or path
                if from_field is not None and from_order is not None:
                    raise RolloutError(f"{from_field} records its step (a `step` field) and {from_order} does not, "
                                       "so their step numbers would mix two orders; give every file's rows their "
                                       "step, or none (the file order numbers the steps)")
                if step in seen:
                    raise RolloutError(f"{path} is step {step} again (its `step` field); pass each step's file once")
                seen.add(step)
                row = step_row(step, batch, summary)
                frame = pd.DataFrame([row])
                if columns is None:
                    columns = list(frame.columns)
                text = frame.reindex(columns=columns).to_csv(header=n == 0, index=False, lineterminator="\n")
                if n == 0:
                    header, _, text = text.partition("\n")
                    f.write(f"{header}\n".encode())
                spans.extend((step, f.tell(), f.write(text.encode())))
                for alarm in watching:
                    alarm.see(step, row)
                if watch is not None:
                    watch.see(f"step {step}", row, order=step)
                if not last or step > last["step"]:
                    last = row
                if progress is not None:
                    progress(n + 1, len(files))
        rows = np.frombuffer(spans, dtype=np.int64).reshape(-1, 3)
        in_order = bool((np.diff(rows[:, 0]) > 0).all())
        if not in_order:
            _sort_rows(tmp / STEPS, rows)
        write_csv(pd.DataFrame([a.row() for a in watching]), tmp / ALARMS)
        figures = draw(tmp, watching) if draw is not None else []
        verdict = watch.verdict if watch is not None else None
        record = build_manifest("history", manifest or {}, {"history": {
            "n_steps": len(files), "alarms": [a.row() for a in watching],
            "steps_from": "the rows' step field" if from_field else "the file order",
            "files_in_step_order": in_order}}, command=sys.argv)
        if verdict is not None:
            record["gate"] = verdict.record()
        record["files"] = {name: {"rows": _rows(tmp / name), "sha256": file_sha256(tmp / name)}
                           for name in (STEPS, ALARMS, *figures)}
        write_json(record, tmp / MANIFEST)
    return History(out_dir, len(files), watching, verdict, last)


def _sort_rows(path: Path, spans: np.ndarray) -> None:
    """Rewrite steps.csv with its rows in step order: each row copied from where it was written (`spans`: step,
    offset, length), one at a time, so the rows never sit in memory together."""
    ordered = path.with_name(path.name + ".sorted")
    with path.open("rb") as rows, ordered.open("wb") as out:
        out.write(rows.read(int(spans[0, 1])))  # the header
        for offset, length in spans[np.argsort(spans[:, 0], kind="stable"), 1:]:
            rows.seek(int(offset))
            out.write(rows.read(int(length)))
    ordered.replace(path)


def _rows(path: Path) -> int:
    if not path.name.endswith(".csv"):
        return 0
    with path.open("rb") as f:
        return max(sum(1 for _ in f) - 1, 0)
