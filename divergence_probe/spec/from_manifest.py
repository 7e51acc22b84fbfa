"""A spec as a manifest recorded it, checked as the CLI checks its flags, before anything loads: a manifest is data
anyone may have edited."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Mapping

from ..errors import ProbeError
from ..options import finite_number
from .fields import flag_of


class _SpecError(Exception):
    """A field of a recorded spec that does not fit (from_dict turns it into one ProbeError)."""


_KIND_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text", dict: "a JSON object"}
_INT_LIMIT = 2**63  # what torch, vLLM and numpy take as a count or a seed; larger is no value the tool wrote


def _hints(cls) -> dict:
    import typing

    return typing.get_type_hints(cls)


# Fields a recorded spec gained after runs were already recorded without them, by (component, field), and the value
# that re-makes what those runs did (the behaviour before the field existed): a folder written before the field is
# still re-runnable. Any other missing field is an error, as an unknown one is.
LATER_FIELDS: dict[tuple[str, str], object] = {
    ("capture", "graft"): False, ("capture", "depth"): False, ("capture", "engine_noise"): False,
    ("align", "routing_replay"): "ids", ("ablate", "build_ahead"): None, ("load", "train_precision"): "bf16",
    ("load", "train_device"): None, ("load", "train_tp"): 1, ("load", "train_kernels"): "torch", ("ablate", "factors"): (),
    ("spec", "train_kernels"): "torch", ("spec", "remedies"): None,
    ("load", "allow_untested_versions"): False, ("generate", "rollouts_format"): "generic",
    ("load", "placement"): "together", ("load", "keep_engine_outputs"): False,
    ("capture", "reference"): None}


def _fields_of(data, known: dict, where: str) -> dict:
    if not isinstance(data, Mapping):
        raise _SpecError(f"{where} is {type(data).__name__}, not a JSON object")
    unknown = sorted(map(str, set(data) - set(known)))
    if unknown:
        raise _SpecError(f"unknown field(s) {', '.join(f'{where}.{n}' for n in unknown)}")
    component = where.rpartition(".")[2].removesuffix("_spec")  # "spec.load", score's "score.load_spec" -> "load"
    later = {n: LATER_FIELDS[(component, n)] for n in known if n not in data and (component, n) in LATER_FIELDS}
    missing = [n for n in known if n not in data and n not in later]
    if missing:
        raise _SpecError(f"{where} lacks the field(s) {', '.join(missing)}")
    return {**later, **data}


def _typed(value, hint, where: str, flag: str):
    """value as the CLI would have parsed it for a field of type `hint`, or _SpecError naming the field."""
    import typing

    args = typing.get_args(hint)
    if type(None) in args:  # X | None
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is tuple:  # a comma list on the command line, a JSON list in the manifest
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        ok, kind = False, "a list of names"
    elif hint is bool:
        ok, kind = isinstance(value, bool), _KIND_WORDS[bool]
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and -_INT_LIMIT < value < _INT_LIMIT
        kind = "a whole number (below 2^63)"
    elif hint is float:
        ok = finite_number(value)
        value, kind = float(value) if ok else value, "a finite number"
    elif hint in (str, dict):
        ok, kind = isinstance(value, hint), _KIND_WORDS[hint]
    else:  # a field type this function does not know: a bug here, not in the manifest
        raise TypeError(f"{where}: no manifest check for fields of type {hint}")
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise _SpecError(f"{where} ({flag}) is {shown}, not {kind}")
    return value


def _build(cls, values, where: str):
    """One component of a recorded spec, every field checked (see RunSpec.from_dict); a field that is a component of
    its own (RLSpec's load) is built as one."""
    known = {f.name: f for f in fields(cls)}
    values = _fields_of(values, known, where)
    hints = _hints(cls)
    typed = {name: _build(hints[name], value, f"{where}.{name}") if is_dataclass(hints[name])
             else _typed(value, hints[name], f"{where}.{name}", flag_of(known[name])) for name, value in values.items()}
    try:
        return cls(**typed)
    except ProbeError as e:
        raise _SpecError(f"{where}: {e}") from e


def recorded(cls, values, where: str):
    """A spec dataclass other than RunSpec (score's, a LoadSpec) as a manifest recorded it, checked as from_dict
    checks a RunSpec: every field there, none unknown, each of its flag's type, then the class's own checks. One
    ProbeError naming the field."""
    try:
        return _build(cls, values, where)
    except _SpecError as e:
        raise ProbeError(f"the recorded {where} does not fit this version of divergence-probe ({e}); fix the "
                         "manifest or re-run the command from its `command` instead") from None


def recorded_value(cls, name: str, value, where: str):
    """One field of the spec class `cls` as a manifest recorded it, for a reader that uses a few (report): of its
    flag's type, and passing the class's own checks with its other fields at their defaults. The ProbeError names the
    field, as `recorded`'s does."""
    f = next(f for f in fields(cls) if f.name == name)
    try:
        typed = _typed(value, _hints(cls)[name], where, flag_of(f))
        try:
            cls(**{name: typed})
        except ProbeError as e:
            raise _SpecError(f"{where}: {e}") from e
    except _SpecError as e:
        raise ProbeError(f"the recorded {where} does not fit this version of divergence-probe ({e}); fix the "
                         "manifest or re-run the command from its `command` instead") from None
    return typed
