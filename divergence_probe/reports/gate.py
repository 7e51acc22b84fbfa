"""`--fail-if METRIC OP VALUE`: a run's pass/fail verdict for CI, read off the summary it writes.

A condition is one comparison, parsed by a tiny grammar (no eval: a CI variable must never run code): a metric
name, one of > >= < <= == !=, and a number or a word (`first_inexact!=attn_core@0`). The run FAILS when any
condition holds. Names are checked against the summary columns the run kind can write (METRICS, the one list)
before anything loads, so a typo costs seconds, not a model load.

A gate that cannot fail is worse than none: CI reads its silence as a pass. So every way a condition could never
hold is refused or fails closed. Refused before anything loads (one line): a threshold that is not a finite number
(nothing compares past NaN), a word against a metric that is a number (`mean_kl==1e-3x`: a typo that would never
equal), a number against a metric that is a word, and a metric the run's own flags say it will not measure (a noise
floor without --batch-invariance, a tap's name under --taps none), naming the flag that would measure it; a routing
metric on a model without mixture-of-experts routers, once its config is read, before the stacks load. Failed
(closed) after the run: a metric the run did not measure after all (a floor the setup could not make, a tap that was
not captured), or a value that is not of its metric's kind.

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
from ..numerics.tables import NOISE_FLOORS, NOT_CAPTURED, SUMMARY_COLUMNS, largest_noise_floor

# Longest operators first: `>=` must not read as `>` followed by `=1`.
OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt}
_CONDITION = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|==|!=|>|<)\s*(\S(?:.*\S)?)\s*$")

# The mismatch in units of the largest noise floor the run measured (tables.largest_noise_floor): computed from the
# summary, not a column of it, so a gate can say "no more than twice what a stack does to itself".
MISMATCH_OVER_FLOOR = "mismatch_over_floor"


def _rl_values(*sides: str) -> dict:
    """Generate mode's RL metrics of a one-token sample, from the functions that make them (rl_metrics), so a metric
    added there is gateable (and typed: a number or a word) without an edit here."""
    one = np.zeros(1)
    responses = pd.DataFrame({"prompt_id": [0], "sample_id": [0], "delta_logprob": [0.0]})
    return {**token_metrics(one, one, 0.2, 2.0), **sequence_metrics(responses, 0.2),
            **(ratio_split({side: one for side in sides}) if len(sides) > 1 else {})}


def _rl_names(*sides: str) -> list[str]:
    return list(_rl_values(*sides))


_ROUTING = ["frac_tokens_any_flip", "frac_tokens_after_flip", "mean_abs_dlogp_after_flip",
            "mean_abs_dlogp_not_after_flip", "frac_tokens_upstream_flip", "mean_abs_dlogp_upstream_flip",
            "mean_abs_dlogp_no_upstream_flip",
            *(f"noise_{side}{change}_{m}" for side in ("infer", "train") for change in ("", "_kernel")
              for m in ("frac_topk_set_differs", "frac_tokens_any_flip"))]
_ROUTED = frozenset(_ROUTING)  # measured on a mixture of experts only
_COMPARE = [*SUMMARY_COLUMNS, *NOISE_FLOORS, "tap_points_mean_abs_dlogp", "prompt_mean_abs_dlogp", "prompt_mean_kl",
            *_rl_names("train", "prefill", "decode"), *_ROUTING, MISMATCH_OVER_FLOOR]
# score's summary (score.ScoreRun.summary): no taps, the recorded logprobs for the engine's, and its diagnosis
# (the ratio's factors by their signed means: their mean |log| are rollout_vs_prefill and prefill_vs_train, written
# once)
_SPLIT = [name for name in ratio_split({s: np.zeros(1) for s in ("train", "prefill", "recorded")})
          if not name.endswith("_mean_abs_dlogp")]
_SCORE = [*(c for c in SUMMARY_COLUMNS if not c.startswith("first_")), *_rl_names("train"), *_SPLIT,
          "rollout_vs_train_mean_abs_dlogp", "rollout_vs_prefill_mean_abs_dlogp", "prefill_vs_train_mean_abs_dlogp",
          "far_bound", "recorded_far", "wrong_token_share", "tempered_mean_abs_dlogp", "untempered_mean_abs_dlogp",
          "fitted_temperature", "likely_cause"]
# score measures these only with the engine's prefill (--infer vllm): the three-way split
_PREFILLED = frozenset({*_SPLIT, "rollout_vs_prefill_mean_abs_dlogp", "prefill_vs_train_mean_abs_dlogp"})
# score measures these only with a model (the trainer's logits): without one, k1, k2 and k3 estimate the KL
_LOGITS = ("mean_kl", "max_kl")
_TEMPERED = ("tempered_mean_abs_dlogp", "untempered_mean_abs_dlogp", "fitted_temperature")
# The metrics that are words (a tap's name, a cause, a factor's name): compared with == and != only, to a word. The
# rest are numbers (a bool reads as 0 or 1, and as the words true and false).
WORDS = frozenset({"first_inexact", "first_over_threshold", "likely_cause",
                   *(name for name, value in _rl_values("train", "prefill", "decode").items()
                     if isinstance(value, str))})
BOOLS = frozenset({"recorded_far"})
_BOOL_WORDS = {"true": 1.0, "false": 0.0}
# The metrics a compare or ablate run measures only when a flag asks for them: the flag to name when a gate reads
# one the run's spec will not measure (will_not_measure).
_TAPPED = ("first_inexact", "first_over_threshold")
_GENERATED = frozenset({*_rl_names("train", "prefill", "decode"), "prompt_mean_abs_dlogp", "prompt_mean_kl"}
                       - set(SUMMARY_COLUMNS))
_ENGINE_NOISE = ("noise_infer_engine_mode_mean_abs_dlogp", "noise_infer_tensor_parallel_mean_abs_dlogp",
                 "tap_points_mean_abs_dlogp")
# The summary columns each run kind can write: the names --fail-if accepts. ablate's and remedies' are compare's (their
# summary.csv has one row per combination or arm; the gate reads the shipped one); history's are score's, per step, and what steps.csv
# adds to them (steps.csv).
METRICS: dict[str, tuple[str, ...]] = {
    "compare": tuple(dict.fromkeys(_COMPARE)),
    "ablate": tuple(dict.fromkeys(_COMPARE)),
    "remedies": tuple(dict.fromkeys(_COMPARE)),  # the stacks as shipped, as ablate's `none`
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
    def parse(cls, text: str, kind: str, flag: str = "--fail-if") -> "Condition":
        """One condition, checked: `flag` (--fail-if, --alarm) names it in the one-line refusal."""
        match = _CONDITION.match(text)
        if match is None:
            raise ProbeError(f"{flag} {text!r} is not METRIC OP VALUE; write e.g. mean_kl>1e-3 or "
                             "first_inexact!=attn_core@0 (OP: > >= < <= == !=)")
        metric, op, raw = match.groups()
        if metric not in METRICS[kind]:
            near = [m for m in METRICS[kind] if metric.lower() in m or m in metric.lower()][:4]
            raise ProbeError(f"{flag} {text!r}: {kind} writes no metric {metric!r}; use a summary column such as "
                             f"{', '.join(near or METRICS[kind][:4])} (docs/reference/outputs.md lists them)")
        try:
            value: float | str = float(raw)
        except ValueError:
            value = _BOOL_WORDS.get(raw.casefold(), raw) if metric in BOOLS else raw
        if isinstance(value, float) and not math.isfinite(value):
            raise ProbeError(f"{flag} {text!r}: the threshold {raw} is not a finite number, so the condition could "
                             "never be judged (nothing compares past NaN); write a finite number, e.g. "
                             f"{metric}>1e-3")
        if metric in WORDS and not isinstance(value, str):
            raise ProbeError(f"{flag} {text!r}: {metric} is a word (a name such as attn_core@0 or none), not a "
                             f"number; compare it to a word with == or !=")
        if metric not in WORDS and isinstance(value, str):
            raise ProbeError(f"{flag} {text!r}: {metric} is a number and {raw!r} is not one, so the condition could "
                             f"never hold; write a number, e.g. {metric}{op}1e-3")
        return cls(f"{metric}{op}{raw}", metric, op, value)

    def check(self, summary: dict) -> tuple[bool, object]:
        """(holds, the value it was read at); a metric the summary lacks, or NaN, holds (fails closed)."""
        value = measured(summary, self.metric)
        if value is None:
            return True, "not measured"
        if isinstance(self.value, str):
            if not isinstance(value, str):
                return True, f"{value!r} (not a word)"
            return OPS[self.op](value.casefold(), self.value.casefold()), value
        if isinstance(value, (bool, np.bool_)):
            value = float(value)
        if not isinstance(value, (int, float, np.integer, np.floating)):
            return True, f"{value!r} (not a number)"
        return OPS[self.op](float(value), self.value), float(value)


def will_not_measure(kind: str, spec, metric: str, model_free: bool = False) -> str | None:
    """The flag that would measure `metric` when a `kind` run of `spec` will not, from its flags alone (and, for a
    score, whether its files let it score without a model: `model_free`); None when it will or may (what only the
    model can tell, a routing metric on a dense model: Gate.check_model)."""
    if kind in ("score", "history"):
        if metric in _LOGITS and model_free:
            return "--model (a KL needs the trainer's logits; the file's logprobs hold none)"
        if metric in _TEMPERED and model_free:
            return "--model (a temperature needs the trainer's logits; the file's logprobs hold none)"
        if metric in _PREFILLED and spec.infer is None:
            return "--infer vllm (the engine's prefill)"
        # with --temperature the headline is the tempered comparison and the raw gap is kept beside it; without it,
        # a far recording gets the temperature that fits it best (and its gap): measured or not, by the data
        if metric == "untempered_mean_abs_dlogp" and spec.temperature is None:
            return "--temperature T (the run's sampling temperature)"
        if metric == "fitted_temperature" and spec.temperature is not None:
            return "no --temperature (a temperature is fitted only when none is given)"
        return None
    capture = spec.capture
    if metric in _TAPPED and not capture.tap_names and capture.taps.strip() != "all":
        return "--taps all (or the taps to capture)"
    if metric in _GENERATED and not spec.generate.generates:
        return "--mode generate"
    if metric in _ENGINE_NOISE and not capture.engine_noise:
        return "--engine-noise"
    if metric == MISMATCH_OVER_FLOOR and not (capture.batch_invariance or capture.engine_noise):
        return "--batch-invariance (a noise floor; or --engine-noise)"
    if metric.startswith("noise_") and metric not in _ENGINE_NOISE and not capture.batch_invariance:
        return "--batch-invariance"
    return None


def measured(summary: dict, metric: str):
    """The value of `metric` in a summary row; None when the run did not measure it."""
    if metric == MISMATCH_OVER_FLOOR:
        largest = largest_noise_floor(summary)
        if largest is None or not largest[1] > 0 or "mean_abs_dlogp" not in summary:
            return None
        return float(summary["mean_abs_dlogp"]) / largest[1]
    value = summary.get(metric)
    uncaptured = isinstance(value, str) and value == NOT_CAPTURED  # no tap was there to diverge
    if value is None or uncaptured or (isinstance(value, float) and math.isnan(value)):
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


NO_RECORDED_GATE = "--no-recorded-gate"  # rerun's switch: judge by its own --fail-if alone
WITHOUT_RECORDED = (f"rerun with {NO_RECORDED_GATE} to leave the recorded gate out (and --fail-if for conditions of "
                    "your own)")


@dataclass(frozen=True)
class Gate:
    conditions: tuple[Condition, ...]
    kind: str = "compare"
    flag: str = "--fail-if"
    # rerun: the conditions the run folder recorded (gate.fail_if). Dropping one is not a flag away there, so its
    # refusal names the switch that reruns without the recorded gate instead.
    recorded: tuple[str, ...] = ()

    @classmethod
    def parse(cls, texts, kind: str, flag: str = "--fail-if") -> "Gate":
        """Every --fail-if (or --alarm: `flag`) of a `kind` run, checked; ProbeError (one line) on the first bad
        one."""
        if kind not in METRICS:
            raise ValueError(f"no gate for run kind {kind!r}; add it to gate.METRICS")
        return cls(tuple(Condition.parse(t, kind, flag) for t in texts or ()), kind, flag)

    def __bool__(self) -> bool:
        return bool(self.conditions)

    def check_measured(self, spec, model_free: bool = False) -> None:
        """Before anything loads: ProbeError (one line, naming the flag that would measure it) for the first
        condition on a metric `spec` (a compare or ablate RunSpec; a score or history ScoreSpec, `model_free` once
        its first file is read) will not measure."""
        for c in self.conditions:
            needed = will_not_measure(self.kind, spec, c.metric, model_free)
            if needed:
                raise self._refusal(c, f"this run will not measure {c.metric}", f"add {needed}, or drop the condition")

    def check_model(self, family) -> None:
        """Once the model's config is read, before its stacks load: ProbeError (one line) for a routing metric when
        the model (`family`, models.Family) has no mixture-of-experts routers to compare."""
        if family.top_k_field is not None:
            return
        for c in self.conditions:
            if c.metric in _ROUTED:
                raise self._refusal(c, f"a {family.model_type} model has no mixture-of-experts routers, so this run "
                                       f"will not measure {c.metric}", "point --model at a MoE checkpoint, or drop "
                                                                       "the condition")

    def _refusal(self, c: Condition, problem: str, fix: str) -> ProbeError:
        if c.text in self.recorded:
            return ProbeError(f"the gate the run folder recorded (gate.fail_if) has {c.text!r}: {problem}; "
                              f"{WITHOUT_RECORDED}")
        return ProbeError(f"{self.flag} {c.text!r}: {problem}; {fix}")

    def judge(self, rows) -> Verdict:
        """`rows`: (where, summary dict) pairs, e.g. one per step. A condition fails at the first row it holds in."""
        watch = GateWatch(self)
        for where, summary in rows:
            watch.see(where, summary)
        return watch.verdict


class GateWatch:
    """A gate judged row by row as a history streams (no rows kept): `see(where, summary, order)` per step. A
    condition fails at the row of least `order` it holds in (a step number: the files need not come in step order),
    else at the first row seen."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self._first: dict[Condition, tuple[float, Failure]] = {}
        self._seen = 0

    def see(self, where: str, summary: dict, order: float | None = None) -> None:
        order = self._seen if order is None else order
        self._seen += 1
        for condition in self.gate.conditions:
            held = self._first.get(condition)
            if held is not None and held[0] <= order:
                continue
            holds, value = condition.check(summary)
            if holds:
                self._first[condition] = (order, Failure(condition.text, value, where))

    @property
    def verdict(self) -> Verdict:
        return Verdict([c.text for c in self.gate.conditions],
                       [self._first[c][1] for c in self.gate.conditions if c in self._first])
