"""Rollout files RL frameworks record (prompt and response token ids, the engine's logprobs), read into Rollouts.

    batch = read_rollouts("step_12.parquet")            # format detected from the field names
    batch = read_rollouts("dump.jsonl.gz", fmt="generic", fields="prompt_ids=p,response_ids=r,logprobs=lp")
"""

from __future__ import annotations

from pathlib import Path

from .adapters import ADAPTERS, FORMATS, choose, parse_fields
from .columns import read_row, row_step
from .read import read_rows
from .record import Rollout, RolloutBatch, RolloutError

__all__ = ["ADAPTERS", "FORMATS", "Rollout", "RolloutBatch", "RolloutError", "read_rollouts"]


def read_rollouts(path: str | Path, fmt: str = "auto", fields: str | None = None) -> RolloutBatch:
    """Every row of the file as a Rollout, checked for shape (ragged rows, bad types, non-finite or positive
    logprobs, empty responses); RolloutError, one line, on the first problem."""
    path = Path(path)
    names = parse_fields(fields)
    rows, sha256 = read_rows(path)
    adapter = choose(fmt, names, rows[0])
    rollouts, steps = [], set()
    for at in range(len(rows)):  # each row let go once read: the file's rows and their Rollouts are not held twice
        row, rows[at] = rows[at], None
        rollouts.append(read_row(adapter, row, at, names))
        steps.add(row_step(row, at))
    if len(steps) > 1:
        raise RolloutError(f"{path} holds rows of several steps ({', '.join(sorted(map(str, steps)))}); write one RL "
                           "step per file")
    trained = [r.train_logprobs is not None for r in rollouts]
    if any(trained) and not all(trained):
        raise RolloutError(f"rows 0 and {trained.index(not trained[0])} of {path} differ: one holds the trainer's "
                           "logprobs, the other not; record them for every row or for none")
    for r in rollouts:
        if not r.prompt_ids or not r.response_ids:
            raise RolloutError(f"row {r.row} of {path} has an empty {'prompt' if not r.prompt_ids else 'response'}; "
                               "every rollout needs at least one token of each")
    first: dict = {}
    for r in rollouts:  # a group is one prompt's samples: a row whose prompt differs was grouped wrongly
        if r.group is not None and first.setdefault(repr(r.group), r).prompt_ids != r.prompt_ids:
            raise RolloutError(f"row {r.row} of {path} is in group {r.group!r} with row {first[repr(r.group)].row} but "
                               "has another prompt; the group field does not group samples of one prompt: fix it or "
                               "leave it out (--fields)")
    return RolloutBatch(path, sha256, adapter.name, rollouts, steps.pop())
