"""The `--taps` value read into tap names: `all`, `none` or a comma list of them, a name it does not know one line.

Apart from the tap vocabulary (taps.py), which imports nothing, so that every module naming a tap (the stacks'
protocol, the report's readers) sits no deeper in the import graph for it.
"""

from __future__ import annotations

from .errors import ProbeError
from .taps import ALL_TAPS


def parse_tap_selection(spec: str) -> frozenset[str]:
    """`all`, `none`, or a comma list of canonical names; unknown names are an error that lists the valid ones."""
    spec = spec.strip()
    if spec == "all":
        return frozenset(ALL_TAPS)
    if spec == "none":
        return frozenset()
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = sorted(set(names) - set(ALL_TAPS))
    if unknown or not names:
        raise ProbeError(
            f"unknown tap name(s) {', '.join(unknown) or repr(spec)}; use all, none, or a comma list of: "
            + ", ".join(ALL_TAPS)
        )
    return frozenset(names)
