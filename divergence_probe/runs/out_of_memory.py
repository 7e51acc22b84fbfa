"""An out-of-memory, whoever raised it (torch on a GPU, a CPU allocation, vLLM's start-up checks), told apart from
other errors, and the part of the run it happened in (memory.out_of_memory_error makes the one line of both, beside
what the plan expected)."""

from __future__ import annotations

import os
import traceback

_OOM_TEXT = ("out of memory", "can't allocate memory", "no available memory for the cache blocks",
             "larger than the available kv cache memory", "less than desired gpu memory utilization",
             "less than desired cpu memory utilization", "less than requested memory for kv")


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), a CPU allocation failure, or one of vLLM's start-up errors for too little
    memory (its text: vllm/v1/core/kv_cache_utils.py, v1/worker/utils.request_memory, cpu_worker.py), also when
    wrapped in one of our errors."""
    import torch

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.OutOfMemoryError):
            return True
        if isinstance(error, (RuntimeError, ValueError, MemoryError)) or type(error).__name__ == "StackError":
            text = str(error).lower()
            if isinstance(error, MemoryError) or any(t in text for t in _OOM_TEXT):
                return True
        error = error.__cause__ or error.__context__
    return False


def part_that_ran_out(error: BaseException) -> str:
    """Which part of the run ran out: the deepest of our modules (or vLLM) in the traceback."""
    places = {"engines/hf": "the training stack's forward", "runs/capture.py": "the tap reduction",
              "numerics/fused.py": "the tap reduction", "numerics/metrics.py": "the tap reduction", "engines/vllm": "the inference engine",
              "/vllm/": "the inference engine", "runs/compare.py": "the run loop"}
    where = "the run"
    for frame in traceback.extract_tb(error.__traceback__):
        path = frame.filename.replace(os.sep, "/")
        for key, name in places.items():
            if key in path:
                where = name
    return where
