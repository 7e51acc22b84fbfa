"""What an op set or an engine setting needs to run (device types, a package), checked before anything loads."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec

from ..errors import ProbeError


@dataclass(frozen=True)
class Needs:
    devices: tuple[str, ...] = ("cpu", "cuda")  # device types it runs on
    package: str | None = None  # the import name of a package it needs beyond the tool's own
    install: str = ""  # how to install that package

    def check(self, what: str, side: str, device: str, instead: str) -> None:
        """`what` (a flag and value) on `side` ("the trainer", "the engine") at `device`: one line naming what is
        missing and what to do `instead`."""
        if device.split(":")[0] not in self.devices:
            raise ProbeError(f"{what} runs on {' or '.join(self.devices)} only, and {side} is on {device}; {instead}")
        if self.package is not None and find_spec(self.package) is None:
            raise ProbeError(f"{what} needs the {self.package} package, which is not installed; {self.install}")
