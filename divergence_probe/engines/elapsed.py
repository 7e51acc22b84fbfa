"""The time a block of work takes, read in the process that does the work: on a GPU from a device synchronize before
it to one after it (the work queued before the block is not the block's, the work it queued is). An engine in a
worker process times its own calls there (WorkerStack.step_time), so the hand-over of their results to this process,
which an engine in this process does not pay, is no part of its step."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class Elapsed:
    """`seconds`: how long the block took (NaN until a block has run). `device`: where its work runs ("cuda",
    "cuda:1", "cpu")."""

    def __init__(self, device: str) -> None:
        self.device, self.seconds = device, float("nan")

    @contextmanager
    def timing(self) -> Iterator["Elapsed"]:
        self._synchronize()
        start = time.perf_counter()
        yield self
        self._synchronize()
        self.seconds = time.perf_counter() - start

    def _synchronize(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
