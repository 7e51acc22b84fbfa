"""Deployment knobs as ablation factors: `ablate --factor SIDE:KEY=VALUE` beside `--regions`.

A factor is a change of the run's load settings that a deployment makes: an FP8 KV cache or FP8 weights in the engine,
the engine's compiled mode, the trainer's kernel set or its mixed precision. Each knob says its side, its key, the
values the tool measures, the LoadSpec field it changes and how, and who checks a value (the engine's own arg check,
the kernel set's device and package check). Every stack declares its own knobs (StackClass.knobs, read through the
registry's `knobs_of`): a new knob is one entry in its stack's table. An ablation runs every subset of its regions and
factors and splits the change of the mismatch among them (numerics/shapley.py); a factor's combinations load what it changes (the
trainer's kernel set is swapped in place; another precision or another engine is loaded beside the run's own).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engines import knobs_of
from ..errors import ProbeError

SIDES = ("engine", "train")


@dataclass(frozen=True)
class Factor:
    knob: object  # engines.protocol.Knob, as the stack that owns it declares it
    value: str

    @property
    def label(self) -> str:
        """How combinations and the attribution name it: engine:kv_cache_dtype=fp8."""
        return f"{self.knob.name}={self.value}"


def parse_factor(text: str) -> Factor:
    """'engine:kv_cache_dtype=fp8' -> its Factor; anything else is one line naming what a factor looks like."""
    name, eq, value = text.strip().partition("=")
    knobs = knobs_of()
    if not eq or name not in knobs:
        side = name.partition(":")[0]
        hint = f"knobs: {', '.join(knobs)}" if side in SIDES else "a region goes in --regions"
        raise ProbeError(f"--factor {text.strip()!r} is not SIDE:KEY=VALUE of a known knob ({hint}), e.g. "
                         "engine:kv_cache_dtype=fp8 or train:kernels=vllm")
    knob = knobs[name]
    if value not in knob.values:
        raise ProbeError(f"--factor {name}={value!r}: {name} takes {', '.join(knob.values)}")
    return Factor(knob, value)


def parse_factors(texts) -> tuple[str, ...]:
    """--factor's values (repeated, each possibly a comma list) -> the factors' labels, checked, without repeats;
    two values of one knob cannot both be factors (a combination would set it twice)."""
    items = [t for text in ([texts] if isinstance(texts, str) else list(texts or ())) for t in text.split(",") if t.strip()]
    factors = [parse_factor(t) for t in items]
    seen: dict[str, str] = {}
    for f in factors:
        if seen.get(f.knob.name, f.label) != f.label:
            raise ProbeError(f"--factor {seen[f.knob.name]} and {f.label} set the same knob; ablate one value of a "
                             "knob at a time")
        seen[f.knob.name] = f.label
    return tuple(dict.fromkeys(f.label for f in factors))


def applied(load, labels) -> object:
    """The LoadSpec a combination with these factors loads (the run's own, changed by each factor's knob)."""
    from dataclasses import replace

    changes: dict = {}
    for label in labels:
        factor = parse_factor(label)
        current = replace(load, **changes) if changes else load
        changes[factor.knob.field] = factor.knob.change(factor.value, current)
    return replace(load, **changes) if changes else load
