"""Deployment knobs as ablation factors: `ablate --factor SIDE:KEY=VALUE` beside `--regions`.

A factor is a change of the run's load settings that a deployment makes: an FP8 KV cache or FP8 weights in the engine,
the engine's compiled mode, the trainer's kernel set or its mixed precision. Each knob says its side, its key, the
values the tool measures, the LoadSpec field it changes and how, and who checks a value (the engine's own arg check,
the kernel set's device and package check). The engine's knobs are its own table (engines/vllm/knobs.py KNOBS), read
here whole: a new engine knob is one entry there. An ablation runs every subset of its regions and factors and
splits the change of the mismatch among them (numerics/shapley.py); a factor's combinations load what it changes (the
trainer's kernel set is swapped in place; another precision or another engine is loaded beside the run's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import ProbeError

SIDES = ("engine", "train")


@dataclass(frozen=True)
class Knob:
    side: str  # "engine" (the inference stack) or "train" (the trainer)
    key: str
    values: tuple[str, ...]  # the settings a factor may name
    field: str  # the LoadSpec field a factor of this knob changes
    change: Callable[[str, object], object]  # (the factor's value, the LoadSpec) -> the field's new value
    check: Callable[[str, str], None]  # (the factor's value, the device) -> None, or a ProbeError: who checks it
    summary: str

    @property
    def name(self) -> str:
        return f"{self.side}:{self.key}"


def _kernels_check(value: str, device: str) -> None:
    from ..engines.hf.kernels import get_kernels

    get_kernels(value).check(device)


def _no_check(value: str, device: str) -> None:
    """Checked by the LoadSpec the factor's combinations load (LoadSpec.__post_init__, RunSpec's own checks)."""


def _knobs() -> dict[str, Knob]:
    from ..engines.hf.kernels import KERNELS
    from ..engines.vllm.knobs import KNOBS as ENGINE

    knobs = [
        *(Knob("engine", knob.key, knob.factor_values, knob.load_field, knob.change, knob.check, knob.summary)
          for knob in ENGINE.values()),  # the engine declares its knobs whole (engines/vllm/knobs.py)
        Knob("train", "kernels", tuple(KERNELS), "train_kernels", lambda value, load: value, _kernels_check,
             "the trainer's kernel set (--train-kernels)"),
        Knob("train", "precision", ("amp", "bf16"), "train_precision", lambda value, load: value, _no_check,
             "the trainer's precision (--train-precision)"),
    ]
    return {knob.name: knob for knob in knobs}


@dataclass(frozen=True)
class Factor:
    knob: Knob
    value: str

    @property
    def label(self) -> str:
        """How combinations and the attribution name it: engine:kv_cache_dtype=fp8."""
        return f"{self.knob.name}={self.value}"


def parse_factor(text: str) -> Factor:
    """'engine:kv_cache_dtype=fp8' -> its Factor; anything else is one line naming what a factor looks like."""
    name, eq, value = text.strip().partition("=")
    knobs = _knobs()
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


def check_factor(label: str, load) -> None:
    """A factor against the run's own load settings, before anything loads: its knob's checker on the device, and a
    value the run already has (no change to attribute) refused."""
    from dataclasses import replace

    from ..environment import resolve_device, resolve_train_device

    factor = parse_factor(label)
    knob = factor.knob
    if knob.side == "engine" and load.infer != "vllm":
        raise ProbeError(f"--factor {label} changes vLLM, but --infer is {load.infer}; drop it or use --infer vllm")
    device = resolve_device(load.device) if knob.side == "engine" else resolve_train_device(load.train_device,
                                                                                            load.device)
    if knob.change(factor.value, load) == getattr(load, knob.field):
        raise ProbeError(f"--factor {label} is what the run already runs; ablate a change (e.g. drop the matching "
                         "--train-*/--engine flag)")
    try:
        knob.check(factor.value, device)
        replace(load, **{knob.field: knob.change(factor.value, load)})  # the LoadSpec's own checks of the change
    except ProbeError as e:
        raise ProbeError(f"--factor {label}: {e}") from None


def applied(load, labels) -> object:
    """The LoadSpec a combination with these factors loads (the run's own, changed by each factor's knob)."""
    from dataclasses import replace

    changes: dict = {}
    for label in labels:
        factor = parse_factor(label)
        current = replace(load, **changes) if changes else load
        changes[factor.knob.field] = factor.knob.change(factor.value, current)
    return replace(load, **changes) if changes else load
