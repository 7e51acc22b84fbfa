"""What every run command does around the API call: the --fail-if gate (checked before anything loads, judged before
the run is written, exit 1 after), the run itself with its progress (compare, ablate and rerun), and the closing
lines (the folder, the report, the next command to try)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from .. import timings
from ..errors import ProbeError
from .console import console, fail, out, phases, say


def closing(out_dir: Path, report: bool, step) -> None:
    """The last lines of every run: its folder, its report (rendered now with --report, else the command that
    renders it) and the next command to try with why (runs/next_steps.py), each on a line of its own to copy."""
    say(f"run: {out_dir}")
    if report:
        write_report(out_dir)
    else:
        say(f"report: {shlex.join(['divergence-probe', 'report', str(out_dir)])}")
    if step is not None:
        say(f"next: {shlex.join(step.argv)}")
        say(f"  why: {step.why}")


def family_of(manifest: dict):
    """The model family a run's manifest names (what it cannot run: Family.unsupported), or None if unknown."""
    from ..models import get_family

    model = manifest.get("model")
    try:
        return get_family(model.get("arch")) if isinstance(model, dict) else None
    except (ProbeError, KeyError, TypeError):
        return None


def next_step(run):
    """A compare or ablate run's next command (runs/next_steps.py)."""
    from ..runs.next_steps import after_ablate, after_compare

    family = family_of(run.manifest)
    if run.spec.kind == "ablate":
        return after_ablate(run.spec, run.attribution_table, family)
    return after_compare(run.spec, run.summary, family)


def gate_of(texts, kind: str):
    """The --fail-if conditions of a `kind` run, checked before anything loads (one line, exit 2, on a bad one)."""
    if not texts:
        return None
    from ..reports.gate import Gate

    try:
        return Gate.parse(texts, kind)
    except ProbeError as e:
        fail(e)


def judged(gate, manifest: dict, rows):
    """The gate's verdict on `rows` ((where, summary) pairs), recorded in the manifest before it is written."""
    if gate is None:
        return None
    verdict = gate.judge(rows)
    manifest["gate"] = verdict.record()
    return verdict


def exit_by(verdict) -> None:
    """After everything is written: the gate's failures, one line each, and exit code 1 (2 stays for user errors)."""
    if verdict is None:
        return
    if verdict.passed:
        out.print(f"gate passed: {', '.join(verdict.conditions)} held nowhere", highlight=False, markup=False)
        return
    for line in verdict.lines():
        console.print(f"[bold red]{escape(line)}[/]", highlight=False, markup=True)
    raise typer.Exit(1)


def _summary_rows(run) -> list[tuple[str, dict]]:
    """What a compare or ablate gate reads: the summary; of an ablation, its shipped combination's row."""
    if run.spec.kind == "ablate":
        from ..numerics.shapley import SHIPPED

        table = run.summary_table
        return [(f"combo {SHIPPED}", table[table["combo"] == SHIPPED].iloc[0].to_dict())]
    return [("run", run.summary)]


def run_spec(make_spec, out_dir: Optional[Path], check=None, gate=None, check_run=None):
    """Shared by compare, ablate and rerun: build (and so validate) the spec and check --out before anything
    loads, load once, run with a progress bar, judge the --fail-if gate, write atomically. `check(source)` runs before
    the stacks load, `check_run(manifest)` on the finished run before it is written (rerun: were these the recorded
    inputs?). Any ProbeError on the way is one line and exit code 2, and nothing is written. Returns the run, its
    folder and the gate's verdict."""
    from transformers.utils import logging as hf_logging

    import divergence_probe as dp
    from ..rundir import claim_out_dir, default_out_dir
    from ..runs.manifest import runnable_command

    hf_logging.disable_progress_bar()  # transformers' per-load bars: the status line above says what is loading
    timings.start()
    try:
        spec = make_spec()
        if gate:
            gate.check_measured(spec)  # a condition this run's flags will not measure: refused before the claim
        out_dir = out_dir or default_out_dir()
        with claim_out_dir(out_dir):  # held until the run is written: a second run aiming here fails at once
            if spec.load.engine_args:
                from ..engines import stack_class

                stack_class(spec.load.infer).check_settings(spec.load, imports=True)  # starts no engine

            with phases() as shown:
                shown.phase("loading the model in transformers and the inference stack")
                timings.add("start", timings.process_age() or 0.0)  # the interpreter, the CLI's imports, the spec
                run = dp.run(spec, shown, check=check, gate=gate or None, spill_near=out_dir, notice=_placement_notice)
                shown.end()
            if check_run is not None:
                check_run(run.manifest)
            run.manifest["command"] = runnable_command()
            run.manifest["phases"] = shown.timings
            if timings.enabled():  # the writing, the report and the exit follow: a whole-process clock has the rest
                run.manifest["timings"] = timings.record() | {"until_written": round(timings.process_age() or 0.0, 3)}
            verdict = judged(gate, run.manifest, _summary_rows(run))
            kept = _kept_outputs(run.manifest)
            run.write(out_dir)
            if kept is not None:
                kept.rename(Path(out_dir) / KEPT_OUTPUTS)
    except ProbeError as e:
        fail(e)
    return run, out_dir, verdict


def _placement_notice(line: str) -> None:
    """The placement the memory plan chose, when it is not the usual one (both stacks together)."""
    if not line.startswith("placement: together"):
        console.print(escape(line), highlight=False, markup=True)


KEPT_OUTPUTS = "engine_outputs"  # --keep-engine-outputs: the chunk files' folder in the run folder


def _kept_outputs(manifest: dict) -> Path | None:
    """--keep-engine-outputs: the folder of the engine's outputs that spilled to chunk files, which goes into the run
    folder once it is written (the manifest says where it will be)."""
    kept = manifest.get("placement", {}).get("kept_outputs", {})
    folder = kept.get("folder")
    if not folder or not Path(folder).is_dir():
        return None
    kept["folder"] = KEPT_OUTPUTS
    return Path(folder)


def write_report(run_dir: Path, out_dir: Optional[Path] = None, fmt: str = "md") -> None:
    from ..reports.render import write_report as render

    try:
        with console.status("rendering the report…"):
            if (Path(run_dir) / "rl.csv").is_file():  # an rl run: its own report (figures of reward and mismatch)
                from ..reports.rl import write_rl_report

                path = write_rl_report(run_dir, out_dir, fmt=fmt)
            else:
                path = render(run_dir, out_dir, fmt=fmt)
    except ProbeError as e:
        fail(e)
    out.print(f"report: {path}")
