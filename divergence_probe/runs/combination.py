"""The probe one combination runs on: an ablation's (runs/ablate.py) or a remedy arm's (runs/remedies.py).

Its trainer factors are the trainer's kernel set swapped in place or another precision loaded beside the run's own;
its engine factors an engine built in a worker process; its regions aligned on both (runs/engine_align.py). Both run
kinds configure their combinations here, so neither imports the other.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import replace

from .engine_align import aligned_probe, needs_engine_build
from .side_settings import engine_settings_for
from ..engines import stack_class
from ..engines.patching import aligned
from ..spec.run import RunSpec

ENGINE_FIELDS = ("engine", "engine_args")  # LoadSpec fields a factor changes on the engine (knobs.py)


def engine_changed(probe, step: RunSpec) -> bool:
    return any(getattr(step.load, f) != getattr(probe.config, f) for f in ENGINE_FIELDS)


def _engine_settings(probe, step: RunSpec):
    """The probe's engine settings (as its memory plan made them) with the combination's engine factors."""
    return engine_settings_for(probe.config, probe.settings, step.load)


def needs_worker(probe, step: RunSpec, side: str) -> bool:
    return engine_changed(probe, step) or needs_engine_build(probe, step.align.regions, side)


def start_worker(probe, step: RunSpec):
    """A started engine worker for a combination: its factors' engine settings, its engine-side regions."""
    from ..regions import patched

    regions = patched(step.align.regions) if step.align.side != "train" else ()
    return stack_class(probe.config.infer).for_settings(_engine_settings(probe, step), regions).start()


@contextmanager
def configured(probe, step: RunSpec, worker):
    """The probe a combination runs on: its trainer factors (the kernel set swapped in place, another precision
    loaded beside) and its engine factors (an engine built in a worker), with its regions aligned."""
    side = step.align.side
    with ExitStack() as stack:
        view = trainer_configured(probe, step, stack)
        if engine_changed(probe, step):
            worker = worker or start_worker(probe, step)
            stack.callback(worker.close)
            worker.wait_ready()
            view = replace(view, infer=worker, owns_infer=False, settings=_engine_settings(probe, step))
            stack.enter_context(aligned([view.train] if side != "infer" else [], step.align.regions))
            yield view
            return
        yield stack.enter_context(aligned_probe(view, step.align.regions, side, worker))


def trainer_configured(probe, step: RunSpec, stack: ExitStack):
    """The probe with a combination's trainer factors: the kernel set swapped in place (undone by `stack`), another
    precision loaded beside the run's own trainer (closed by `stack`)."""
    view = probe
    if step.load != probe.config:
        view = replace(probe, config=step.load)
    train_changes = {f: getattr(step.load, f) for f in ("train_precision",)
                     if getattr(step.load, f) != getattr(probe.config, f)}
    if train_changes:  # another trainer, loaded beside the run's own for this combination
        view = probe.with_trainer(**train_changes, train_kernels=step.load.train_kernels)
        view = replace(view, config=step.load)
        stack.callback(view.train.close)
    elif step.load.train_kernels != probe.config.train_kernels:
        stack.enter_context(probe.train.kernels_used(step.load.train_kernels))
    return view
