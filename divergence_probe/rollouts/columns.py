"""Both sides of the ratio from the file alone. RL frameworks record, per response token, the engine's logprob and
their trainer's logprob of the same token (adapters.Adapter.train names the field); with both, a step's mismatch
is measured without loading the model, at any size.

The trainer's column is read by the format's own adapter with that column in place of the engine's, so it is
unpadded and masked exactly as the engine's is (the same positions survive), and checked the same way.
"""

from __future__ import annotations

import math
from dataclasses import replace

from .adapters import Adapter
from .record import Rollout, RolloutError

# Fields a step's rows may carry beside the tokens: the RL step (the file's place in a run) and the sample's reward.
STEP_FIELD = "step"
REWARD_FIELD = "reward"


def read_row(adapter: Adapter, row: dict, at: int, fields: dict[str, str]) -> Rollout:
    """One row as a Rollout, its `train_logprobs` filled when the row holds the trainer's column (`--fields train=`
    or the format's own), and its reward when the row records a number under REWARD_FIELD."""
    if fields.get("infer"):
        row = {**row, adapter.logprobs: _column(row, fields["infer"], at)}
    rollout = adapter.read(row, at)
    train = fields.get("train") or adapter.train
    reward = row.get(REWARD_FIELD)
    if isinstance(reward, (int, float)) and type(reward) is not bool and math.isfinite(reward):
        rollout = replace(rollout, reward=float(reward))
    if row.get(train) is None:
        if fields.get("train"):
            _column(row, train, at)  # named by the user: its absence is an error
        return rollout
    try:
        trained = adapter.read({**row, adapter.logprobs: row[train]}, at)
    except RolloutError as e:  # the adapter names its engine field; the problem is in the trainer's column
        raise RolloutError(str(e).replace(f"`{adapter.logprobs}`", f"`{train}`")) from None
    return replace(rollout, train_logprobs=trained.logprobs)


def _column(row: dict, name: str, at: int):
    if row.get(name) is None:
        raise RolloutError(f"row {at} has no `{name}` (named by --fields); fields there: "
                           f"{', '.join(sorted(map(str, row))[:12])}")
    return row[name]


def row_step(row: dict, at: int):
    """The row's STEP_FIELD when it holds a non-negative integer, else None."""
    step = row.get(STEP_FIELD)
    if step is None:
        return None
    if type(step) is not int or step < 0:
        raise RolloutError(f"row {at}: `{STEP_FIELD}` is {step!r}, not a non-negative integer; fix the field or drop "
                           "it (the file order then numbers the steps)")
    return step
