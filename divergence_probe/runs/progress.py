"""How a run reports progress: a (done, total) callback, and the phases a display that shows them is told of."""

from __future__ import annotations

from typing import Callable

Progress = Callable[[int, int], None]  # (prompts done, prompts total)


def phase(progress: Progress | None, name: str, *, offset: int = 0, scale: int = 1) -> None:
    """Tell a progress display that shows phases (the CLI's: one bar per long phase, with the time left) that a new
    one starts: the calls that follow count from `offset` and their total is `scale` times this phase's. A plain
    (done, total) callback has no `phase` and sees the same calls as ever."""
    start = getattr(progress, "phase", None)
    if start is not None:
        start(name, offset=offset, scale=scale)
