"""The peak memory a block of work takes above where it began, read in the process that does the work: on a GPU the
CUDA allocator's own peak (reset when the block begins); on the CPU the resident set of the process, sampled by a
thread (torch's CPU allocator hands large blocks back to the system, so the resident set follows what the work holds).
An engine in a worker process is read there: its device allocator by the worker itself, its resident set from here
(WorkerStack.peak_memory)."""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

SAMPLE_SECONDS = 0.002  # how often the resident set is read while the block runs


class PeakMemory:
    """`peak`: bytes above the block's start at its highest (NaN until a block has run). `device`: where this
    process's work runs ("cuda", "cuda:1", "cpu"); `pid`: on the CPU, the process whose resident set is read (None:
    this one)."""

    def __init__(self, device: str, pid: int | None = None) -> None:
        self.device, self.pid, self.peak = device, pid, float("nan")

    @contextmanager
    def measuring(self) -> Iterator["PeakMemory"]:
        if self.device.startswith("cuda") and self.pid is None:
            import torch

            torch.cuda.synchronize(self.device)  # work queued before the block is not the block's
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            yield self
            torch.cuda.synchronize(self.device)
            self.peak = float(torch.cuda.max_memory_allocated(self.device) - before)
            return
        before, high, done = resident(self.pid), [0], threading.Event()

        def sample() -> None:
            while not done.wait(SAMPLE_SECONDS):
                high[0] = max(high[0], resident(self.pid))

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        try:
            yield self
        finally:
            done.set()
            watcher.join()
            self.peak = float(max(high[0], resident(self.pid)) - before)


def resident(pid: int | None = None) -> int:
    """The resident set of a process (None: this one), in bytes; 0 once it has exited."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (FileNotFoundError, ProcessLookupError):
        return 0
