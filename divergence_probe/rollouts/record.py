"""One sampled response as a rollout file recorded it, in the tool's own terms, whatever framework wrote it, and a
file's rows as one batch: the plain records every layer that reads rollouts names, with no reader behind them."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ProbeError


_LARGEST_FLOAT = int(sys.float_info.max)


class RolloutError(ProbeError):
    """The rollout file cannot be read, or a row does not hold what its format promises."""


@dataclass(frozen=True)
class Rollout:
    """`logprobs[j]` is the engine's logprob of `response_ids[j]` given the prompt and the response before it.
    `group` ties the samples of one prompt together (None: the row is its own prompt); `routed_experts` is kept
    as the file gave it (MoE engines record it) and is not yet compared. `train_logprobs[j]`, when the file holds
    them, are the framework's trainer's logprob of the same token."""

    row: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    group: object = None
    routed_experts: object = None
    train_logprobs: tuple[float, ...] | None = None  # the trainer's, when the file records them (columns.py)
    reward: float | None = None


@dataclass(frozen=True)
class RolloutBatch:
    path: Path
    sha256: str
    format: str
    rollouts: list[Rollout]
    step: int | None = None  # the rows' `step` field, when they record one

    @property
    def has_train(self) -> bool:
        """Every row holds the trainer's logprobs too: the mismatch needs no model (columns.py)."""
        return all(r.train_logprobs is not None for r in self.rollouts)


def token_ids(row: dict, key: str, at: int) -> list[int]:
    """A field that must be a list of token ids (non-negative integers)."""
    value = field(row, key, at)
    if not isinstance(value, (list, tuple)) or not all(type(v) is int for v in value):
        raise RolloutError(f"row {at}: `{key}` is {_kind(value)}, not a list of token ids; the file's column types do "
                           "not match its format (pass --format or --fields for the right columns)")
    if any(v < 0 for v in value):
        raise RolloutError(f"row {at}: `{key}` holds a negative token id; the file is not a rollout of token ids")
    return list(value)


def logprobs(row: dict, key: str, at: int) -> list[float]:
    """A field that must be a list of finite logprobs (≤ 0: a log-probability never exceeds 0)."""
    value = field(row, key, at)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, float)) and type(v) is not bool
                                                       for v in value):
        raise RolloutError(f"row {at}: `{key}` is {_kind(value)}, not a list of logprobs; the file's column types do "
                           "not match its format (pass --format or --fields for the right columns)")
    for j, v in enumerate(value):
        if type(v) is int and abs(v) > _LARGEST_FLOAT:  # JSON ints have any number of digits; no float holds them
            raise RolloutError(f"row {at}: `{key}`[{j}] is an integer of {len(str(abs(v)))} digits, which no logprob "
                               "is; the column holds something else: pass the logprob column with --fields")
        if not math.isfinite(v):
            raise RolloutError(f"row {at}: `{key}`[{j}] is {v}; the engine recorded a non-finite logprob, so this "
                               "rollout cannot be scored: drop the row or fix the recording")
        if v > 0:
            raise RolloutError(f"row {at}: `{key}`[{j}] is {v} > 0, which no log-probability is; the column holds "
                               "something else (probabilities? rewards?): pass the logprob column with --fields")
    return [float(v) for v in value]


def mask(row: dict, key: str, at: int, length: int) -> list[bool] | None:
    """An optional 0/1 mask of `length` entries; None when the row has none."""
    if row.get(key) is None:
        return None
    value = row[key]
    if not isinstance(value, (list, tuple)) or not all(v in (0, 1, True, False) for v in value):
        raise RolloutError(f"row {at}: `{key}` is {_kind(value)}, not a 0/1 mask")
    if len(value) != length:
        raise RolloutError(f"row {at}: `{key}` has {len(value)} entries for {length} tokens; the row is ragged")
    return [bool(v) for v in value]


def field(row: dict, key: str, at: int):
    if key not in row or row[key] is None:
        raise RolloutError(f"row {at} has no `{key}`; every row of this format needs it (fields there: "
                           f"{', '.join(sorted(map(str, row))[:12])})")
    return row[key]


def same_length(at: int, ids_key: str, ids: list, lp_key: str, lps: list) -> None:
    if len(ids) != len(lps):
        raise RolloutError(f"row {at}: {len(lps)} logprobs in `{lp_key}` for {len(ids)} tokens in `{ids_key}`; the "
                           "row is ragged (one logprob per response token is needed)")


def _kind(value) -> str:
    if isinstance(value, (list, tuple)):
        inner = next((v for v in value if not (type(v) is int or isinstance(v, float))), None)
        return f"a list holding {type(inner).__name__}" if inner is not None else "a list"
    return f"a {type(value).__name__}"
