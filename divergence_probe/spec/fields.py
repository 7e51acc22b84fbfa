"""What every spec component shares: the one check of a choice-valued flag and of a number-valued one, and the flag a
field is spelled as."""

from __future__ import annotations

from dataclasses import Field, fields

from ..errors import ProbeError
from ..options import finite_number


def _choice(value, allowed, flag: str) -> None:
    if value not in allowed:
        raise ProbeError(f"{flag} {value!r} is not valid; choose one of: {', '.join(map(str, allowed))}")


def flag_of(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def check_finite(spec) -> None:
    """ProbeError naming the flag of the first float field of the dataclass `spec` that is not finite (inf, nan)."""
    for f in fields(spec):
        value = getattr(spec, f.name)
        if isinstance(value, float) and not finite_number(value):
            raise ProbeError(f"{flag_of(f)} is {value}; it must be a finite number")
