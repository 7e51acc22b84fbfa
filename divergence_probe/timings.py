"""Where a run's wall time goes, phase by phase: opt-in, recorded in the manifest as `timings`.

With DIVERGENCE_PROBE_TIMINGS=1 in the environment, each `timed(name)` block adds its wall seconds to `name`, and a
run's manifest gets them (cli/runner.py); without it, `timed` hands back one shared do-nothing context, so the run
loop pays a function call per block and nothing else. Names nest with dots ("score.train.reduction" is inside "score.train"):
a parent's seconds include its children's. On CUDA each block ends with a device synchronize while timing is on, so
the kernels a block launched are counted in it and not in whichever block happens to wait for them next: timing
changes how the host and the device overlap, which is why it is off by default.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import ContextManager

ENV = "DIVERGENCE_PROBE_TIMINGS"
_OFF: ContextManager[None] = contextlib.nullcontext()
_seconds: dict[str, float] | None = {} if os.environ.get(ENV) == "1" else None  # None while timing is off


def enabled() -> bool:
    return _seconds is not None


def start() -> None:
    """Time this process's phases from now on, from nothing, when the environment asks for it (each CLI run starts
    here; the environment is read again, so a test can turn timing on and off)."""
    global _seconds
    _seconds = {} if os.environ.get(ENV) == "1" else None


def timed(name: str) -> ContextManager[None]:
    return _OFF if _seconds is None else _timed(name)


@contextlib.contextmanager
def _timed(name: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        _synchronize()
        _seconds[name] = _seconds.get(name, 0.0) + time.perf_counter() - started


def add(name: str, seconds: float) -> None:
    """Record a span measured elsewhere (the process's start, before any of our code ran)."""
    if _seconds is not None:
        _seconds[name] = _seconds.get(name, 0.0) + seconds


def record() -> dict[str, float] | None:
    """The seconds so far, rounded to the millisecond, or None while timing is off."""
    return None if _seconds is None else {name: round(s, 3) for name, s in sorted(_seconds.items())}


def process_age() -> float | None:
    """Seconds since this process started (the interpreter's own start-up and every import before now included), or
    None where the kernel does not say (Linux's /proc gives the start in clock ticks since boot)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat; 20th after the command's name
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _synchronize() -> None:
    torch = sys.modules.get("torch")  # never imports torch: a run that has not imported it has launched no kernels
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
