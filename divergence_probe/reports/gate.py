"""`--fail-if METRIC OP VALUE`: a run's pass/fail verdict for CI, read off the summary it writes.

A condition is one comparison, parsed by a tiny grammar (no eval: a CI variable must never run code): a metric
name, one of > >= < <= == !=, and a number or a word (`first_inexact!=attn_core@0`). The run FAILS when any
condition holds. Names are checked against the summary columns the run kind can write (METRICS, the one list)
before anything loads, so a typo costs seconds, not a model load. A metric the run did not measure (a noise floor
that was not asked for) fails the gate: a check that could not be made cannot vouch for the run.

    gate = Gate.parse(["mean_kl>1e-3", "first_inexact!=attn_core@0"], "compare")
    verdict = gate.judge([("run", summary)])     # verdict.passed, verdict.failures, verdict.record()
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..errors import ProbeError
from ..numerics.rl_metrics import ratio_split, sequence_metrics, token_metrics
from ..numerics.tables import NOISE_FLOORS, SUMMARY_COLUMNS, largest_noise_floor

# Longest operators first: `>=` must not read as `>` followed by `=1`.
OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt}
_CONDITION = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|==|!=|>|<)\s*(\S(?:.*\S)?)\s*$")

# The mismatch in units of the largest noise floor the run measured (tables.largest_noise_floor): computed from the
# summary, not a column of it, so a gate can say "no more than twice what a stack does to itself".
MISMATCH_OVER_FLOOR = "mismatch_over_floor"


def _rl_names(*sides: str) -> list[str]:
    """Generate mode's RL metric names, from the functions that make them (rl_metrics), so a metric added there is
    gateable without an edit here."""
    one = np.zeros(1)
    responses = pd.DataFrame({"prompt_id": [0], "sample_id": [0], "delta_logprob": [0.0]})
    return [*token_metrics(one, one, 0.2, 2.0), *sequence_metrics(responses, 0.2),
            *ratio_split({side: one for side in sides})]


_ROUTING = ["frac_tokens_any_flip", "frac_tokens_after_flip", "mean_abs_dlogp_after_flip",
            "mean_abs_dlogp_not_after_flip", "frac_tokens_upstream_flip", "mean_abs_dlogp_upstream_flip",
            "mean_abs_dlogp_no_upstream_flip",
            *(f"noise_{side}{change}_{m}" for side in ("infer", "train") for change in ("", "_kernel")
              for m in ("frac_topk_set_differs", "frac_tokens_any_flip"))]
_COMPARE = [*SUMMARY_COLUMNS, *NOISE_FLOORS, "tap_points_mean_abs_dlogp", "prompt_mean_abs_dlogp", "prompt_mean_kl",
            *_rl_names("train", "prefill", "decode"), *_ROUTING, MISMATCH_OVER_FLOOR]
# score's summary (score.ScoreRun.summary): no taps, the recorded logprobs for the engine's, and its diagnosis
_SCORE = [*(c for c in SUMMARY_COLUMNS if not c.startswith("first_")), *_rl_names("train", "prefill", "recorded"),
          "rollout_vs_train_mean_abs_dlogp", "rollout_vs_prefill_mean_abs_dlogp", "prefill_vs_train_mean_abs_dlogp",
          "far_bound", "recorded_far", "wrong_token_share", "tempered_mean_abs_dlogp", "likely_cause"]
# The summary columns each run kind can write: the names --fail-if accepts. ablate's are compare's (its summary.csv
# has one row per combination; the gate reads the shipped one); history's are score's, per step, and what steps.csv
# adds to them (steps.csv).
METRICS: dict[str, tuple[str, ...]] = {
    "compare": tuple(dict.fromkeys(_COMPARE)),
    "ablate": tuple(dict.fromkeys(_COMPARE)),
    "score": tuple(dict.fromkeys(_SCORE)),
    "history": tuple(dict.fromkeys([*_SCORE, "n_rollouts", "reward_mean"])),  # + history.step_row's own columns
}


@dataclass(frozen=True)
class Condition:
    """METRIC OP VALUE; `value` is a float when the text reads as a number, else the word itself."""

    text: str
    metric: str
    op: str
    value: float | str

    @classmethod
    def parse(cls, text: str, kind: str) -> "Condition":
        match = _CONDITION.match(text)
        if match is None:
            raise ProbeError(f"--fail-if {text!r} is not METRIC OP VALUE; write e.g. mean_kl>1e-3 or "
                             "first_inexact!=attn_core@0 (OP: > >= < <= == !=)")
        metric, op, raw = match.groups()
        if metric not in METRICS[kind]:
            near = [m for m in METRICS[kind] if metric.lower() in m or m in metric.lower()][:4]
            raise ProbeError(f"--fail-if {text!r}: {kind} writes no metric {metric!r}; use a summary column such as "
                             f"{', '.join(near or METRICS[kind][:4])} (docs/reference/outputs.md lists them)")
        try:
            value: float | str = float(raw)
        except ValueError:
            value = raw
        if isinstance(value, str) and op not in ("==", "!="):
            raise ProbeError(f"--fail-if {text!r}: {op} compares numbers, and {raw!r} is not one; use == or != for "
                             "a word")
        return cls(f"{metric}{op}{raw}", metric, op, value)

    def check(self, summary: dict) -> tuple[bool, object]:
        """(holds, the value it was read at); a metric the summary lacks, or NaN, holds (fails closed)."""
        value = measured(summary, self.metric)
        if value is None:
            return True, "not measured"
        if isinstance(self.value, str):
            text = str(value)
            return OPS[self.op](text.casefold(), self.value.casefold()), text
        if isinstance(value, (bool, np.bool_)):
            value = float(value)
        if not isinstance(value, (int, float, np.integer, np.floating)):
            return True, f"{value!r} (not a number)"
        return OPS[self.op](float(value), self.value), float(value)


def measured(summary: dict, metric: str):
    """The value of `metric` in a summary row; None when the run did not measure it."""
    if metric == MISMATCH_OVER_FLOOR:
        largest = largest_noise_floor(summary)
        if largest is None or not largest[1] > 0 or "mean_abs_dlogp" not in summary:
            return None
        return float(summary["mean_abs_dlogp"]) / largest[1]
    value = summary.get(metric)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value.item() if isinstance(value, np.generic) else value


@dataclass(frozen=True)
class Failure:
    condition: str
    value: object
    where: str  # "run", or "step 12" for a history


@dataclass
class Verdict:
    conditions: list[str]
    failures: list[Failure] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def record(self) -> dict:
        """manifest.json's `gate`: what was asked, and what failed where at which value."""
        return {"fail_if": self.conditions, "passed": self.passed,
                "failed": [{"condition": f.condition, "value": f.value, "where": f.where} for f in self.failures]}

    def lines(self) -> list[str]:
        return [f"gate failed: {f.condition} ({f.where}: {_shown(f.value)})" for f in self.failures]


def _shown(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Gate:
    conditions: tuple[Condition, ...]

    @classmethod
    def parse(cls, texts, kind: str) -> "Gate":
        """Every --fail-if of a `kind` run, checked; ProbeError (one line) on the first bad one."""
        if kind not in METRICS:
            raise ValueError(f"no gate for run kind {kind!r}; add it to gate.METRICS")
        return cls(tuple(Condition.parse(t, kind) for t in texts or ()))

    def __bool__(self) -> bool:
        return bool(self.conditions)

    def judge(self, rows) -> Verdict:
        """`rows`: (where, summary dict) pairs, e.g. one per step. A condition fails at the first row it holds in."""
        watch = GateWatch(self)
        for where, summary in rows:
            watch.see(where, summary)
        return watch.verdict


class GateWatch:
    """A gate judged row by row as a history streams (no rows kept): `see(where, summary)` per step."""

    def __init__(self, gate: Gate) -> None:
        self.gate, self.verdict = gate, Verdict([c.text for c in gate.conditions])
        self._pending = list(gate.conditions)

    def see(self, where: str, summary: dict) -> None:
        for condition in list(self._pending):
            holds, value = condition.check(summary)
            if holds:
                self.verdict.failures.append(Failure(condition.text, value, where))
                self._pending.remove(condition)
