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


def _signed_pct(share) -> str:
    """A share of the shipped metric in percent with its sign (the attribution's convention: − removes, + adds)."""
    return f"{100 * float(share):+.3g}%"
