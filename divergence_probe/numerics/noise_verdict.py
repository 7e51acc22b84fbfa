"""Is the mismatch more than noise? The mismatch between the stacks (mean |Δlogp|) over the largest floor the run
measured, with a bootstrap interval over prompts, and a verdict worded from that interval, not from the point ratio:
a ratio of 1.1 on a handful of prompts says nothing a ratio of 0.9 would not.

The ratio depends on two samples of the same prompts: the mismatch's tokens and the floor's (each stack scoring the
same sequences twice). A draw resamples prompts once and reweights both, so the interval carries the floor's
prompt-to-prompt spread as well as the mismatch's, paired by prompt; holding the floor at its measured value would
make the interval too narrow. Below shapley.MIN_PROMPTS prompts no interval is given (a percentile bootstrap on a
handful of prompts covers far less than its level) and the verdict says how many it needs.

A floor is of one of two kinds (tables.FLOOR_KINDS): noise, a stack's own run-to-run or batch-to-batch wobble, or
systematic, one deliberate swap (an attention kernel, an engine mode, a sharding) whose difference is the same every
time. The verdict names the floor it is against and its kind: "within a systematic floor" says the mismatch is no
larger than that swap makes, not that it is noise.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .shapley import MIN_PROMPTS, bootstrap, per_prompt
from .tables import FLOOR_KINDS, NOISE_FLOORS, largest_noise_floor

DRAWS = 1000  # bootstrap resamples of prompts
LEVEL = 0.95
RATIO = "mismatch_over_floor"  # summary.csv: mean_abs_dlogp / the largest floor
VERDICT = "noise_verdict"
FLOOR_USED = "noise_floor_used"  # summary.csv: the summary column of the floor the ratio is against
FLOOR_KIND = "noise_floor_kind"  # summary.csv: that floor's kind, tables.FLOOR_KINDS
PROMPTS = "noise_verdict_prompts"  # summary.csv: the prompts the interval resampled
ABOVE, WITHIN, CANNOT_TELL, TOO_FEW = "above_floor", "within_floor", "cannot_tell", "too_few_prompts"
FLOOR_PROMPT_COLUMNS = ["floor", "prompt_id", "n", "sum_abs_dlogp"]  # floor_prompts: one row per (floor, prompt)


def verdict(low: float, high: float) -> str:
    """above_floor when the whole interval is above 1, within_floor when the whole of it is at or below 1."""
    if low > 1:
        return ABOVE
    if high <= 1:
        return WITHIN
    return CANNOT_TELL


def paired_ratio_interval(mismatch: pd.DataFrame, floor: pd.DataFrame, seed: int, draws: int = DRAWS,
                          level: float = LEVEL) -> tuple[float, float]:
    """The bootstrap interval of (Σ w·mismatch sums / Σ w·mismatch tokens) / (Σ w·floor sums / Σ w·floor tokens):
    both tables per prompt (index prompt_id, columns n and sum_abs_dlogp), one weight per prompt shared by the two.
    A prompt the floor did not score counts 0 tokens there. NaN, NaN below MIN_PROMPTS (shapley.bootstrap)."""
    floor = floor.reindex(mismatch.index, fill_value=0)
    ms, mc = (mismatch[c].to_numpy(np.float64) for c in ("sum_abs_dlogp", "n"))
    fs, fc = (floor[c].to_numpy(np.float64) for c in ("sum_abs_dlogp", "n"))

    def ratio(w: np.ndarray) -> dict[str, float]:
        f = w @ fs / (w @ fc) if w @ fc else float("nan")
        return {RATIO: float(w @ ms / (w @ mc)) / f if f else float("nan")}

    return bootstrap(len(mismatch), ratio, draws, seed, level)[RATIO]


def floor_columns(tokens: pd.DataFrame, summary: dict, seed: int, floor_prompts: pd.DataFrame) -> dict:
    """summary.csv's ratio, its interval, the verdict and the floor it is against; nothing when no floor was
    measured. `floor_prompts`: each floor's per-prompt |Δlogp| sums (FLOOR_PROMPT_COLUMNS), resampled with the
    mismatch's. A floor of exactly 0 has no ratio: any mismatch is above it, none is within it."""
    largest = largest_noise_floor(summary)
    if largest is None:
        return {}
    name, floor = largest
    mismatch = float(summary["mean_abs_dlogp"])
    p = per_prompt(tokens)
    used = {FLOOR_USED: name, FLOOR_KIND: FLOOR_KINDS[name], PROMPTS: len(p)}
    nan = float("nan")
    if floor == 0:
        return {RATIO: nan, RATIO + "_ci_low": nan, RATIO + "_ci_high": nan,
                VERDICT: ABOVE if mismatch > 0 else WITHIN} | used
    if len(p) < MIN_PROMPTS:
        return {RATIO: mismatch / floor, RATIO + "_ci_low": nan, RATIO + "_ci_high": nan, VERDICT: TOO_FEW} | used
    mine = floor_prompts[floor_prompts["floor"] == name].set_index("prompt_id")[["n", "sum_abs_dlogp"]]
    low, high = paired_ratio_interval(p, mine, seed)
    return {RATIO: mismatch / floor, RATIO + "_ci_low": low, RATIO + "_ci_high": high,
            VERDICT: verdict(low, high)} | used


def manifest_record(summary: dict) -> dict:
    """The manifest's `noise_verdict`: the same numbers as summary.csv, with the floor they are against."""
    if VERDICT not in summary:
        return {}
    name, floor = largest_noise_floor(summary)

    def number(key: str) -> float | None:  # no ratio over a floor of 0, no interval below MIN_PROMPTS: null in JSON
        value = float(summary[key])
        return None if value != value else value

    return {"noise_verdict": {"verdict": summary[VERDICT], "ratio": number(RATIO),
                              "ci": [number(RATIO + "_ci_low"), number(RATIO + "_ci_high")], "level": LEVEL,
                              "draws": DRAWS, "min_prompts": MIN_PROMPTS, "floor": name,
                              "floor_kind": FLOOR_KINDS[name], "floor_mean_abs_dlogp": floor}}


def _floor_of(summary) -> str:
    name = summary.get(FLOOR_USED)
    # a run folder from before the floor was recorded: the largest one, as then
    return name if isinstance(name, str) else largest_noise_floor(summary)[0]


def in_words(summary) -> str | None:
    """The verdict as a user reads it, naming the floor and its kind ("above the noise floor", "within the
    systematic floor"), with what would settle a `cannot_tell` or a `too_few_prompts`; None without a floor."""
    v = summary.get(VERDICT)
    if v is None or (isinstance(v, float) and v != v):
        return None
    name = _floor_of(summary)
    kind = FLOOR_KINDS[name]
    floor = f"the {kind} floor"
    against = f"the floor: {NOISE_FLOORS[name]}, a {kind} floor"
    ratio, low, high = (float(summary.get(k, float("nan"))) for k in (RATIO, RATIO + "_ci_low", RATIO + "_ci_high"))
    if ratio != ratio:  # a floor of exactly 0: no ratio
        return (f"above {floor}: the largest {kind} floor is exactly 0 and the mismatch is not ({against})"
                if v == ABOVE else
                f"within {floor}: the mismatch and the largest {kind} floor are both exactly 0 ({against})")
    if v == TOO_FEW:
        n = summary.get(PROMPTS)
        has = f"{int(n)} prompts" if isinstance(n, (int, float)) and n == n else "too few prompts"
        return (f"cannot tell from {floor}: the mismatch is {ratio:.3g}x its largest floor ({NOISE_FLOORS[name]}, "
                f"a {kind} floor) on {has}, too few for an interval; it needs at least {MIN_PROMPTS} prompts "
                "(--num-prompts, a larger --prompts file)")
    span = (f"{ratio:.3g}x its largest floor ({NOISE_FLOORS[name]}, a {kind} floor; {LEVEL:.0%} interval over "
            f"prompts {low:.3g}x to {high:.3g}x, the floor's prompts resampled with the mismatch's)")
    return {ABOVE: f"above {floor}: the mismatch is {span}",
            WITHIN: f"within {floor}: the mismatch is {span}",
            CANNOT_TELL: f"cannot tell from {floor}: the mismatch is {span}, an interval that straddles 1; more "
                         "prompts (--num-prompts, a larger --prompts file) would narrow it"}[v]


def floor_moved(before, after, label: str) -> str | None:
    """When two combinations of an ablation (summary rows: the shipped one, `before`, and `label`'s, `after`) get
    different verdicts and the floor each is read against differs too: a sentence saying how much the floor moved,
    since part of the verdict's change is then the floor's and not the mismatch's. None otherwise."""
    v0, v1 = before.get(VERDICT), after.get(VERDICT)
    if not (isinstance(v0, str) and isinstance(v1, str)) or v0 == v1:
        return None
    n0, n1 = _floor_of(before), _floor_of(after)
    f0, f1 = float(before[n0]), float(after[n1])
    if n0 == n1 and f0 == f1:
        return None
    which = "" if n0 == n1 else f"; from {NOISE_FLOORS[n0]} to {NOISE_FLOORS[n1]}"
    return (f"The verdict moves from {v0} as shipped to {v1} with {label}, and the floor it is read against moved "
            f"too, from {f0:.3g} to {f1:.3g} nats{which}: part of that change is the floor's, not the mismatch's.")


def as_read(summary, prompts: int | None) -> dict:
    """A recorded summary row as the verdict reads it today: a run folder from before the minimum number of prompts
    may hold an interval on fewer; that interval is dropped and the verdict is too_few_prompts, as a run today
    would write it. `prompts`: how many the run scored (None: not known, the row as recorded)."""
    row = dict(summary)
    v = row.get(VERDICT)
    if prompts is None or prompts >= MIN_PROMPTS or not isinstance(v, str) or v == TOO_FEW:
        return row
    nan = float("nan")
    ratio = row.get(RATIO, nan)
    if not (isinstance(ratio, float) and ratio == ratio):  # a floor of 0: no interval either way
        return row
    return row | {VERDICT: TOO_FEW, PROMPTS: prompts, RATIO + "_ci_low": nan, RATIO + "_ci_high": nan}
