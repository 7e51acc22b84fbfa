"""A Probe holds one model loaded in two stacks (inference and training) and runs experiments on it.

    import divergence_probe as dp
    probe = dp.load("Qwen/Qwen2.5-1.5B", infer="vllm", dtype="bfloat16")
    run = probe.compare(taps="all")  # the packaged sample prompts; prompts="my_prompts/" for your own
    print(run.summary)
    run.write("runs/qwen")

Loading is the expensive part (engine start-up), so a Probe is made once and reused for every
comparison and ablation on that model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .compare import run_compare
from .loading import LoadedStacks, load_stacks, memory_errors
from .progress import Progress
from .. import timings
from ..errors import ProbeError
from ..quiet import libraries_quieted
from ..spec.load import LoadSpec
from ..spec.run import RunSpec, check_family, flat_fields, spec_from_flat

LoadConfig = LoadSpec  # the name of earlier releases


@dataclass
class Probe(LoadedStacks):
    """The loaded stacks (runs/loading.py) and the runs made on them: compare and ablate."""

    def run(self, spec: RunSpec, progress: Progress | None = None):
        """Run a spec on the loaded stacks; its load settings must be the ones this probe was loaded with. An
        out-of-memory on the way is one DeviceMemoryError naming where it happened and the fix."""
        if spec.load != self.config:
            raise ProbeError("the run spec asks for other load settings than this probe was loaded with; "
                             "load a probe for them (divergence_probe.run(spec) does both)")
        if spec != self.checked:  # the load checked the run it was prepared for; another is checked here
            self.prompts.clear()
            check_family(spec, self.config, self.source.family)
        self.checked = None  # a later run reads its prompt files again: they may have changed
        with libraries_quieted(self.quiet), memory_errors(self.memory_plan, "run"):
            run = self._run(spec, progress)
        if "placement" in run.manifest:  # both stacks together: the engine ran every prompt once per combination
            run.manifest["placement"]["engine_passes"] = len(run.runs) if spec.kind != "compare" else 1
        return run

    def _run(self, spec: RunSpec, progress: Progress | None):
        self.infer.begin_run()  # the manifest's captured-logits gap describes this run alone
        # The kinds that run many compares on one probe are imported when such a run runs: a compare needs neither,
        # and each brings the modules of its own arms.
        if spec.kind == "ablate":
            from .ablate import run_ablation

            return run_ablation(self, spec, progress)
        if spec.kind == "remedies":
            from .remedies import run_remedies

            return run_remedies(self, spec, progress)
        from .engine_align import aligned_probe

        with aligned_probe(self, spec.align.regions, spec.align.side) as probe:
            return run_compare(probe, spec, progress)

    def compare(self, *, progress: Progress | None = None, generate: dict | None = None, **options):
        """Diff the two stacks on prompts. `options` are compare's flags by their Python names (prompts, taps,
        align, side, mode, max_new_tokens, ...: `divergence_probe.spec.flat_fields("compare")`); `generate`, a
        dict of generate-mode options, is shorthand for mode="generate" plus those options."""
        return self.run(self._spec("compare", generate, options), progress)

    def ablate(self, *, progress: Progress | None = None, generate: dict | None = None, **options):
        """Every subset of `regions` aligned, one compare (or generate-mode run) each, and the attribution."""
        return self.run(self._spec("ablate", generate, options), progress)

    def _spec(self, kind: str, generate: dict | None, options: dict) -> RunSpec:
        if generate is not None:
            options = options | {"mode": "generate"} | generate
        load_options = sorted(set(options) & {name for component, _, name in flat_fields(kind) if component == "load"})
        if load_options:
            raise ProbeError(f"{', '.join(load_options)}: load settings are fixed when a probe is loaded; pass them to "
                             "divergence_probe.load(...) (or use probe.with_trainer(...) for the training side)")
        return spec_from_flat(kind, load=self.config, **options)


def load(model: str | None = None, *, spec: LoadSpec | None = None, before_stacks=None, taps: str | None = None,
         plan_for: RunSpec | None = None, routes: bool = False, quiet: bool = True, **config) -> Probe:
    """Resolve the model, load it into the training stack (checking weights) and the inference stack.
    `config`: the fields of `divergence_probe.spec.LoadSpec` (infer, dtype, device, engine, ...).
    `taps` (e.g. "all"): the layer taps later runs will ask for. Only a compiled engine cares: it is then built with
    tap points, which is another compiled graph than vLLM as deployed, and device buffers for exactly these taps
    (engines/vllm/compiled_taps.py): later runs can capture those, not others.
    `routes`: a compiled engine of a mixture of experts gets tap points for its route records even without taps
    (rl records every rollout's routes there); a run that replays routes (`plan_for`) implies it.
    `before_stacks(source, tokenizer)` runs once the checkpoint and tokenizer are known and before the slow loads:
    the CLI checks the prompts there, so a bad prompt fails in seconds, not after an engine start.
    `plan_for`: the run this probe is loaded for. Before either stack loads, the memory plan (runs/memory.py) sizes
    vLLM's KV cache, the tap batch and the reduction for its prompts, taps and mode, or fails in one line when nothing
    fits; without it, the plan assumes every tap and batches of one prompt of --batch-tokens tokens.
    `quiet`: the libraries' own output (vLLM's and transformers' logs, the hub's progress bars) is quieted while
    the probe loads and runs, as the CLI quiets it (quiet.py); quiet=False shows it."""
    return load_stacks(model, spec=spec, before_stacks=before_stacks, taps=taps, plan_for=plan_for, routes=routes,
                       quiet=quiet, loaded=Probe, **config)


def run(spec: RunSpec, progress: Progress | None = None, *, quiet: bool = True, before_stacks=None,
        spill_near: Path | None = None, notice: Callable[[str], None] | None = None, check=None, gate=None):
    """Load the spec's model, run it, and return the run (CompareRun or AblationRun). `quiet`, `before_stacks`: as
    load's. `check(source)` and `gate.check_model(family)` (reports/gate.py) are asked once the model is resolved,
    before anything loads (rerun: is this the recorded checkpoint?). The memory plan places the stacks (--placement): both loaded at once, or one at a time (runs/alternate.py),
    the engine's outputs kept in between, in chunk files beside `spill_near` (the run folder to be) when the host
    cannot hold them. `notice(line)` is told which placement and why, before anything loads."""
    from .alternate import run_alternate
    from .loading import load_prepared, prepare

    with libraries_quieted(quiet):
        with timings.timed("load"):
            prepared = prepare(spec.load, before_stacks, spec.capture.taps, spec, can_alternate=spec.kind != "remedies",
                               spill_near=spill_near, check=_arms_checked(spec, check), gate=gate)
        if notice is not None:
            notice(f"placement: {prepared.placement['placement']} ({prepared.placement['why']})")
        if prepared.alternate:
            from .ablate import run_ablation_kept

            with timings.timed("run"):  # the engine's pass and the trainer's, each with its own load
                return run_alternate(prepared, spec, progress, run_ablation_kept)
        with timings.timed("load"):
            probe = load_prepared(prepared, Probe)
    probe.quiet = quiet
    with timings.timed("run"):
        return probe.run(spec, progress)


def _arms_checked(spec: RunSpec, check):
    """`check(source)`, and for a remedies run its arms planned once the model's family is known (runs/remedies.py
    plan_arms): a run none of whose arms can run is refused before its stacks load."""
    if spec.kind != "remedies":
        return check

    def checked(source) -> None:
        if check is not None:
            check(source)
        from .remedies import plan_arms

        plan_arms(spec, source.family)
    return checked
