"""--placement alternate: one stack on the device at a time, for a model whose weights fit the device once.

Colocated RL frameworks never hold the engine and the trainer at once either: the engine rolls out, leaves the device,
the trainer steps. Here the engine runs first: every call a compare (or each engine-side combination of an ablation)
makes of it, in the run's order (`_engine_pass` makes the calls `compare.run_compare` makes, with nothing but the
engine loaded), its outputs copied to the host (engines/kept.py; chunk files when the host cannot hold them: the
memory plan decided that before anything loaded). The engine runs in a worker process of its own, which exits when
the engine passes are done: whatever it held on the device and the host is returned then, on every platform (vLLM's
sleep mode exists on CUDA only, and would keep the weights in host memory for a wake-up this run never makes). Then
the trainer loads on the same device and the run loop runs unchanged against the kept outputs (engines/kept.KeptEngine
answers each engine call with its recording): the same taps in the same order, the same pairing and reduction, so
the same numbers as a run with both stacks together.
"""

from __future__ import annotations

import gc
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from .batch_invariance import NoiseEngines, engine_noise, measure_side, routing_taps
from .capture import TapPairing
from .compare import _route_capture, capturable_taps, engine_prefill, run_compare, source_for
from .loading import LoadedStacks, Prepared, memory_errors, stack_for
from .progress import Progress, phase
from .side_settings import engine_settings, engine_settings_for, train_settings
from ..engines import stack_class
from ..engines.kept import KeptEngine, KeptNoise, KeptOutputs, Recording, RecordingNoise
from ..engines.patching import aligned
from ..numerics.shapley import subsets
from ..prompts import batches
from ..versions import environment
from ..spec.run import RunSpec



def _ignore(*_) -> None:
    pass


def _engine_pass(view, spec: RunSpec, noise) -> None:
    """The engine's calls of run_compare(view, spec), in its order; `view.infer` records them."""
    _, prompts = view.run_prompts(spec)
    taps, _ = capturable_taps(view, spec)
    routes, infer_taps, _ = _route_capture(view, spec, TapPairing([]), taps)
    source = source_for(spec)
    ran = []
    for group in batches(prompts, source.batch_tokens(view), source.batch_count(view)):
        ran += [seq.prompt for seq in source.run(view, group, infer_taps, _ignore, len(ran))]
    if source.mode == "generate":
        engine_prefill(view.infer, ran)
    if spec.capture.batch_invariance:
        measure_side("infer", view.infer, ran)
    if spec.capture.engine_noise:
        engine_noise(view, ran, spec.align.regions if spec.align.side != "train" else (), noise)
    if spec.capture.batch_invariance and routes is not None and routes.metrics and ran:
        routing_taps(view.infer, ran)


def _worker_for(infer, settings, regions: tuple[str, ...], workers: dict):
    """The started engine of these settings, in a worker process of its own (`infer`: its StackClass): an eager
    engine takes each pass's regions call by call, so one serves them all; a compiled one has them built in."""
    built = regions if settings.engine == "compiled" else ()
    key = (settings, built)
    if key not in workers:
        workers[key] = worker = infer.for_settings(settings, built)  # kept first: closing covers a failed start
        worker.load(settings)
    worker = workers[key]
    worker.patched = () if built else regions
    return worker


def _in_process_engine(infer, settings, regions: tuple[str, ...], stack: ExitStack):
    """An engine built in no worker process (--infer hf: a second transformers instance): loaded here, closed when
    the passes are done."""
    engine = infer.for_settings(settings)
    engine.load(settings)
    stack.callback(engine.close)
    if regions:
        stack.enter_context(aligned([engine], regions))
    return engine


def run_alternate(prepared: Prepared, spec: RunSpec, progress: Progress | None = None, ablate=None):
    """Run `spec` one stack at a time (the placement `prepared` chose): the engine passes, the engine gone, the
    trainer against their outputs. Returns the CompareRun or AblationRun a run with both stacks together returns.
    `ablate`: an ablation's trainer pass (ablate.run_ablation_kept), passed in by the caller."""
    cfg, settings = prepared.config, prepared.settings
    steps = [spec.combination(c) for c in subsets(spec.ablate.players)] if spec.kind == "ablate" else [spec]
    configurations = list(dict.fromkeys(step.engine_configuration for step in steps))
    folder = Path(prepared.kept["folder"]) if prepared.kept.get("kept") == "file" else None
    kept = {c: KeptOutputs(folder / f"pass-{i}" if folder is not None else None) for i, c in enumerate(configurations)}
    trainer_probe, done = None, False
    try:
        with memory_errors(prepared.plan, "the engine's pass over the prompts"):
            recorded, starts = _engine_passes(prepared, steps, configurations, kept, progress)
        memory_after = _memory_after_release(settings.device)
        phase(progress, "loading the model in transformers")
        train = stack_for(cfg.train, settings)
        with memory_errors(prepared.plan, "loading the training stack"):
            train.load(train_settings(cfg, settings))
        capabilities, info, _ = recorded[configurations[0]]
        trainer_probe = LoadedStacks(cfg, prepared.source, settings, KeptEngine(kept[configurations[0]], capabilities, info), train,
                              prepared.tokenizer, environment(settings.device), memory_plan=prepared.plan,
                              placement=prepared.placement, prompts=prepared.prompts)
        with memory_errors(prepared.plan, "run"):
            run = _trainer_passes(trainer_probe, spec, kept, recorded, progress, ablate)
        run.manifest["placement"] = prepared.placement | {
            "engine_passes": len(configurations), "engine_starts": starts, "engine_release": stack_class(cfg.infer).released,
            "memory_after_release": memory_after,
            "kept_outputs": {**{k: v for k, v in prepared.kept.items() if k != "folder"},
                             "planned_bytes": prepared.kept["bytes"],
                             "bytes": sum(k.bytes for k in kept.values()),
                             "chunks": sum(k.chunks for k in kept.values()),
                             "folder": str(folder) if folder is not None and cfg.keep_engine_outputs else None}}
        done = True
        return run
    finally:
        if trainer_probe is not None:
            trainer_probe.close()
        keep = done and cfg.keep_engine_outputs  # a failed run leaves nothing beside --out
        for outputs in kept.values():
            outputs.close(keep=keep)
        if folder is not None and not keep:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)


def _engine_passes(prepared: Prepared, steps: list[RunSpec], configurations: list, kept: dict, progress
                   ) -> tuple[dict, int]:
    """Every engine configuration's pass (the first combination that has it makes its calls), recorded into `kept`;
    every engine closed at the end. Returns each configuration's (capabilities, info) and the engines started."""
    cfg, settings = prepared.config, prepared.settings
    infer = stack_class(cfg.infer)
    recorded = {}
    workers: dict = {}
    with ExitStack() as stack:
        noise = RecordingNoise(NoiseEngines(cfg.infer))
        stack.callback(noise.close)
        stack.callback(lambda: [w.close() for w in workers.values()])
        for i, configuration in enumerate(configurations):
            step = next(s for s in steps if s.engine_configuration == configuration)
            phase(progress, f"the engine, pass {i + 1}/{len(configurations)}: every prompt")
            step_settings = engine_settings_for(cfg, settings, step.load)  # as the run's view has them (noise engines')
            regions = configuration[2]
            with ExitStack() as inner:
                if infer.workers:
                    engine = _worker_for(infer, engine_settings(step_settings), regions, workers)
                else:
                    engine = _in_process_engine(infer, engine_settings(step_settings), regions, inner)
                engine.begin_run()
                noise.kept = kept[configuration]
                view = LoadedStacks(step.load, prepared.source, step_settings, Recording(engine, kept[configuration]),
                                    stack_for(cfg.train, settings), prepared.tokenizer, prompts=prepared.prompts)
                _engine_pass(view, step, noise)
                recorded[configuration] = (engine.capabilities(), engine.info())
        starts = len(workers) + len(noise) + (len(configurations) if not infer.workers else 0)
    gc.collect()
    for configuration in configurations:  # the other-mode engines --engine-noise built, answered from the recordings
        recorded[configuration] += (len(noise),)
    return recorded, starts


def _trainer_passes(probe, spec: RunSpec, kept: dict, recorded: dict, progress, ablate):
    """The run on the trainer against its engine pass's outputs; the regions aligned in the trainer alone (the engine
    ran with its own)."""
    def engine_for(step):
        capabilities, info, builds = recorded[step.engine_configuration]
        outputs = kept[step.engine_configuration]
        return KeptEngine(outputs, capabilities, info), KeptNoise(outputs, builds)

    if spec.kind == "ablate":
        return ablate(probe, spec, engine_for, progress)
    engine, noise = engine_for(spec)
    view = replace(probe, infer=engine, owns_infer=False,
                   settings=engine_settings_for(probe.config, probe.settings, spec.load))
    with aligned([view.train] if spec.align.side != "infer" else [], spec.align.regions):
        return run_compare(view, spec, progress, noise_engines=noise)


def _memory_after_release(device: str) -> dict:
    """What the device holds once the engine is gone and before the trainer loads."""
    from ..models.size import device_memory

    if device == "cuda":
        import torch

        # the engine's outputs came back through this process's device on their way to the host: the blocks they
        # left in its allocator's cache go back to the driver, so the trainer's load starts from an empty device
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return {"device": "cuda", "free_bytes": int(free), "total_bytes": int(total),
                "allocated_by_this_process_bytes": int(torch.cuda.memory_allocated()),
                "reserved_by_this_process_bytes": int(torch.cuda.memory_reserved())}
    free, total, source = device_memory(device)
    return {"device": device, "free_bytes": int(free), "total_bytes": int(total), "source": source}
