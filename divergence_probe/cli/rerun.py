"""`rerun`: a run folder's manifest read back (runs/rerun.py checks every field as the flags are checked), shown, and
run again into a new folder by the command that made it (compare or ablate, score, rl)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import ProbeError
from .console import fail, say
from .options import OutOpt, help_from_doc
from .rl import rl_run
from .runner import closing, exit_by, next_step, run_spec
from .score import next_after_score, print_score, score_run
from .tables import print_ablation, print_summary


@help_from_doc
def rerun_command(
    run_dir: Path = typer.Argument(..., help="A run folder written by compare, ablate, score or rl (its manifest.json)."),
    out_dir: Optional[Path] = OutOpt,
    report: bool = typer.Option(False, "--report", help="Render OUT/report after the run is written."),
    allow_engine_arg: Optional[list[str]] = typer.Option(
        None, "--allow-engine-arg", help="Replay this engine arg of the manifest although it is not one rerun replays "
        "without asking (docs/reference/commands.md, 'rerun'); repeatable. Only for a run folder whose maker you trust."),
    fail_if: Optional[list[str]] = typer.Option(
        None, "--fail-if", help="Also fail when METRIC OP VALUE holds (as compare's --fail-if), beside the gate the "
        "run recorded, which rerun replays: exit 1 after writing everything when any condition holds; repeatable."),
    no_recorded_gate: bool = typer.Option(
        False, "--no-recorded-gate", help="Judge the new run by rerun's own --fail-if alone, leaving out the gate the "
        "run recorded: the way out when a recorded condition is refused (one an older version accepted)."),
) -> None:
    """Run again exactly what a run folder's manifest recorded (its spec), into a new folder.

    The prompt files (of a score run: the rollout file) and the model's config must be the ones the run used
    (their sha256 are checked). A manifest is untrusted data: every field is checked as the CLI checks its flags,
    engine args that could load or run code are refused unless --allow-engine-arg names them (an rl run's reward
    plug-in is refused: rerun replays the built-in rewards alone), and what will run is shown before anything loads.
    A run made with --fail-if is judged again by the gate it recorded (exit 1 when a condition holds).

    Examples:
      divergence-probe rerun runs/normal
      divergence-probe rerun runs/normal --report --out runs/normal-again
      divergence-probe rerun runs/ci-last-good --fail-if 'mean_kl>1e-3'
    """
    from ..reports.gate import METRICS
    from ..runs.rerun import RecordedRun, describe, recorded_gate
    from ..run_folder import read_run
    from ..rundir import MANIFEST, default_out_dir

    where = f"{run_dir}/{MANIFEST}"
    target = out_dir or default_out_dir()
    if (Path(run_dir) / "rl.csv").is_file():  # an rl run folder: rl.csv and rl_summary.csv, no summary.csv
        if fail_if:
            fail(ProbeError("--fail-if gates a compare, ablate or score run's summary; an rl run has none to gate, "
                             "so drop --fail-if"))
        rerun_rl(run_dir, where, target, report, allow_engine_arg or ())
        return
    try:
        manifest = read_run(run_dir).manifest  # refuses a cut or changed run folder, and files outside it
        kind = manifest.get("kind")
        gate = recorded_gate(manifest, kind if kind in METRICS else "compare", fail_if, where, not no_recorded_gate)
    except ProbeError as e:
        fail(e)
    if kind == "score":
        rerun_score(manifest, run_dir, where, target, report, gate)
        return
    recorded = RecordedRun(manifest, Path(run_dir), where)

    def make_spec():
        spec = recorded.read_spec(report, allow_engine_arg or ())
        if gate:
            gate.check_measured(spec)  # a gate refused is the one line, before what would run is shown
        for line in describe(spec, target, gate):  # before anything loads: what this folder makes the tool run
            say(line)
        return spec

    run, out_dir, verdict = run_spec(make_spec, target, recorded.check, gate=gate, check_run=recorded.check_run)
    (print_ablation if run.spec.kind == "ablate" else print_summary)(run)
    closing(out_dir, report, next_step(run))
    exit_by(verdict)


def rerun_score(manifest: dict, run_dir: Path, where: str, out_dir: Path, report: bool, gate) -> None:
    """rerun of a score run folder: its recorded ScoreSpec and LoadSpec, checked, shown, then scored again and
    judged by its gate."""
    from ..runs.rerun import describe_score, recorded_score, same_model

    try:
        call, load, rollouts_sha256 = recorded_score(manifest, where)
        if gate:
            gate.check_measured(call)
    except ProbeError as e:
        fail(e)
    for line in describe_score(call, load, out_dir, gate):  # before anything loads: what this folder will run
        say(line)
    run, verdict = score_run(call, load, out_dir, lambda source: same_model(manifest, source, run_dir, "score"),
                              gate=gate, rollouts_sha256=rollouts_sha256)
    print_score(run)
    closing(out_dir, report, next_after_score(call, load, run))
    exit_by(verdict)


def rerun_rl(run_dir: Path, where: str, out_dir: Path, report: bool, allowed) -> None:
    """rerun of an rl run folder: its recorded RLSpec checked and shown, then run again on the checkpoint it was made
    with."""
    from ..runs.rerun import describe_rl, recorded_rl_run, same_model

    try:
        manifest, spec = recorded_rl_run(Path(run_dir), where, allowed)
    except ProbeError as e:
        fail(e)
    for line in describe_rl(spec, out_dir):  # before anything loads: what this folder makes the tool run
        say(line)
    rl_run(spec, out_dir, report, lambda source: same_model(manifest, source, run_dir, "rl"))
