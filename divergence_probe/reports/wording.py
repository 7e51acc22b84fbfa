"""The phrasing every section of a report shares: how a value, a code name, a signed share and a factor of the RL
ratio are written, and the safe lookup into a manifest that may lack a key."""

from __future__ import annotations

import math

from .document import sig

# The factors of the RL ratio π_train/π_recorded (rl_metrics.ratio_split), in plain words: generate mode's three, and
# score's prefill/recorded, which is prefill/decode × decode/recorded when the recording has no decode beside it.
GENERATE_FACTORS = ("train_vs_prefill", "prefill_vs_decode")  # the third, decode/recorded, is 1: the recording
FACTORS = {
    "train_vs_prefill": "the trainer against the engine's prefill of the same sequences (the two stacks' numerics)",
    "prefill_vs_decode": "the engine's prefill against its own decode path (KV cache, a token per step, other batches)",
    "decode_vs_recorded": "the decode path against the recording",
    "prefill_vs_recorded": "the engine's prefill against the recording (its decode path, and whatever the recording "
                           "adds: score has no decode of its own)",
}


def _get(mapping, *keys, default=None):
    for key in keys:
        if not isinstance(mapping, dict) or key not in mapping:
            return default
        mapping = mapping[key]
    return mapping


def _code(value) -> str:
    return "`" + str(value).replace("`", "'") + "`"


def _num(value) -> str:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return str(value)
    return "n/a" if math.isnan(x) else sig(x)


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _signed(value) -> str:
    """A change with its sign and 3 significant digits (the attribution's convention: − removes, + adds)."""
    return f"{float(value):+.3g}"


def _signed_pct(share) -> str:
    """A share of the shipped metric in percent with its sign."""
    return _signed(100 * float(share)) + "%"


def interval(low, high, level: str, signed=_signed) -> str:
    """"95% interval -0.00123 to +0.000456": a bootstrap interval as every section words it, its ends written by
    `signed` (_signed_pct for shares)."""
    return f"{level} interval {signed(low)} to {signed(high)}"


def scored_prompts(run) -> int | None:
    """How many prompts a run scored: the manifest's count (a folder's prompts.jsonl may be cut), else the folder's."""
    recorded = _get(run.manifest, "compare", "num_prompts")
    return int(recorded) if isinstance(recorded, int) else run.n_prompts


def read_intervals(run, attribution):
    """attribution.csv as the words read it: the share intervals of a run that scored fewer than MIN_PROMPTS prompts
    (a folder from before the minimum) left out, as a run today would write none; and whether they were."""
    from ..numerics.shapley import MIN_PROMPTS

    prompts = scored_prompts(run)
    if prompts is None or prompts >= MIN_PROMPTS:
        return attribution, False
    return attribution.assign(share_ci_low=float("nan"), share_ci_high=float("nan")), True


def too_few_prompts(run) -> str:
    from ..numerics.shapley import MIN_PROMPTS

    return (f"The run scored {scored_prompts(run)} prompts, fewer than the {MIN_PROMPTS} a bootstrap interval needs "
            "(docs/reference/outputs.md, \"How many prompts\"): the intervals attribution.csv holds are not read, and no "
            "effect here is a detected one. ")


def share_interval(low, high, level: str) -> str:
    """" (95% interval -10% to -8.13%)" after a share whose interval excludes 0; "" otherwise, the words of a share
    whose interval holds 0 or that has none carrying what there is to say (shapley.effect_words)."""
    from ..numerics.shapley import ADDS, REMOVES, effect

    if not (_finite(low) and _finite(high)) or effect(float(low), float(high)) not in (REMOVES, ADDS):
        return ""
    return f" ({interval(low, high, level, _signed_pct)})"
