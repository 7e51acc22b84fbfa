"""What every spec component shares: the one check of a choice-valued flag, and the flag a field is spelled as."""

from __future__ import annotations

from dataclasses import Field

from ..errors import ProbeError


def _choice(value, allowed, flag: str) -> None:
    if value not in allowed:
        raise ProbeError(f"{flag} {value!r} is not valid; choose one of: {', '.join(map(str, allowed))}")


def flag_of(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")
