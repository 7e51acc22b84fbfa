"""Aligning regions on a probe's stacks for one run, including a compiled engine (rebuilt in a worker process).

An eager engine and transformers take region patches in place (`regions.aligned`). A compiled engine has traced
its modules already, so the engine-side regions of a run need an engine built with them: it runs in a worker
process (`stacks.vllm.worker`; vLLM's CPU backend hosts one engine per process), and the run sees a probe whose
inference stack is that worker. The shipped combination keeps the probe's own engine.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Iterator, Sequence

from ..engines import stack_class
from ..engines.patching import aligned
from ..engines.protocol import PATCH_AT_BUILD
from ..regions import patched


def stacks_for(probe, side: str) -> list:
    return {"both": [probe.infer, probe.train], "train": [probe.train], "infer": [probe.infer]}[side]


def needs_engine_build(probe, regions: Sequence[str], side: str) -> bool:
    """Whether these regions on this side change the engine and the loaded engine takes them only when it is built."""
    return bool(patched(regions)) and side in ("both", "infer") and probe.infer.capabilities().patch == PATCH_AT_BUILD


def engine_worker(probe, regions: Sequence[str]):
    """A started (not yet built) worker engine with the probe's engine settings and `regions` aligned."""
    return stack_class(probe.config.infer).for_settings(probe.settings, patched(regions)).start()


@contextmanager
def aligned_probe(probe, regions: Sequence[str], side: str, worker=None) -> Iterator[object]:
    """The probe to run with `regions` aligned on `side`, for the duration of the block.

    `worker`: an already started engine worker for these regions (ablate starts the next combination's engine
    while the current one runs); closed on exit either way."""
    with ExitStack() as stack:
        if not needs_engine_build(probe, regions, side):
            if worker is not None:
                stack.callback(worker.close)
            stack.enter_context(aligned(stacks_for(probe, side), regions))
            yield probe
            return
        worker = worker or engine_worker(probe, regions)
        stack.callback(worker.close)
        worker.wait_ready()
        view = replace(probe, infer=worker, owns_infer=False)
        stack.enter_context(aligned([view.train] if side == "both" else [], regions))
        yield view
