"""`score`: the rollouts an RL run recorded, scored with the training stack (runs/score.py); several files, a folder
or a glob: the run's history, step by step (runs/history.py). Its options are ScoreSpec's and LoadSpec's fields
(options.score_flags), beside --alarm, --fail-if and --out."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..errors import ProbeError
from .console import fail, out, phases, say
from .options import (FAIL_IF_HELP, command_doc, fail_if_parameter, generated, keyword, out_parameter, parameters,
                      score_flags)
from .runner import closing, exit_by, gate_of, judged

SCORE_DOC = command_doc("""Score the rollouts your RL run recorded with the training stack, as generate mode's trainer side does.

    Writes generate mode's files (tokens.csv with logprob_rollout beside logprob_train, buckets.csv, summary.csv
    with the RL metrics, manifest.json with the file's sha256 and the format read). A file that records the
    trainer's logprobs too (verl old_log_probs, OpenRLHF action_log_probs, slime log_probs, TRL old_per_token_logps,
    or --fields train=COL) needs no --model. Several files: steps.csv, alarms.csv and steps.png, one row per step.
    See docs/reference/score.md, "score:
    what your RL run saw".

    Examples:
      divergence-probe score rollouts/step_120.parquet --model M
      divergence-probe score r.jsonl.gz --model M --infer vllm --temperature 0.7
      divergence-probe score rollouts.parquet --format verl --dtype float16
    """)
ROLLOUTS_HELP = ("Rollout file your RL run recorded: .jsonl, .jsonl.gz or .parquet. Several files, a folder or a glob: "
                 "one file per RL step, scored step by step into steps.csv (the run's history).")
ALARM_HELP = ("Several steps: mark the first step where METRIC >VALUE (a steps.csv column); repeatable. Default: k3>1e-3 "
              "and frac_abs_dlogp_over_ln2>1e-3.")


def score_command(rollouts: list[Path], out_dir: Optional[Path] = None, alarm: Optional[list[str]] = None,
                  fail_if: Optional[list[str]] = None, **flags) -> None:
    from ..runs.history import parse_alarms, step_files
    from ..rundir import default_out_dir
    from ..spec.load import LoadSpec
    from ..spec.score import ScoreSpec

    try:
        files = step_files(rollouts)
        many = len(files) > 1 or any(Path(p).is_dir() for p in rollouts)
        gate = gate_of(fail_if, "history" if many else "score")
        alarms = parse_alarms(alarm) if many else None
        if alarm and not many:
            raise ProbeError("--alarm marks steps of a run's history; pass several rollout files (a folder or a "
                             "glob), or drop --alarm")
        owner = {flag.name: flag.owner for flag in score_flags()}
        call = ScoreSpec(rollouts=str(files[0].absolute()),
                         **{k: v for k, v in flags.items() if owner[k] is ScoreSpec})
        load = LoadSpec(**{k: v for k, v in flags.items() if owner[k] is LoadSpec})
        for conditions in (gate, alarms):
            if conditions:
                conditions.check_measured(call)
    except ProbeError as e:
        fail(e)
    out_dir = out_dir or default_out_dir()
    if many:
        score_history(files, call, load, out_dir, alarms, gate)
        return
    run, verdict = score_run(call, load, out_dir, gate=gate)
    print_score(run)
    closing(out_dir, False, next_after_score(call, load, run))
    exit_by(verdict)


def make_score_command():
    """score's typer command: the rollouts, then the spec fields of spec.score.SCORE_FLAGS with --alarm and --fail-if
    before the last of them, then --out (the order --help has always listed them in)."""
    params = parameters(score_flags())
    params[-1:-1] = [keyword("alarm", Optional[list[str]], typer.Option(None, "--alarm", help=ALARM_HELP)),
                     fail_if_parameter(help=FAIL_IF_HELP + " Several steps: fails when it holds at any step.")]
    rollouts = inspect.Parameter("rollouts", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=list[Path],
                                 default=typer.Argument(..., help=ROLLOUTS_HELP))
    return generated(score_command, [rollouts, *params, out_parameter()], SCORE_DOC, "score_command")


def next_after_score(call, load, run):
    """score's next command; none after a model-free one (splitting its gap needs the checkpoint, which only the
    user can name)."""
    from ..runs.next_steps import after_score
    from ..runs.paired import RECORDED_TRAINER

    if run.manifest["score"].get("trainer") == RECORDED_TRAINER:
        return None
    return after_score(call, load, run.summary)


def score_history(files, call, load, out_dir: Path, alarms, gate) -> None:
    """score over many steps (runs/history.py): steps.csv, alarms.csv, steps.png; the alarms that fired; the gate."""
    from transformers.utils import logging as hf_logging

    from ..runs.score import score_steps
    from ..reports.steps import draw_steps
    from ..rundir import claim_out_dir

    hf_logging.disable_progress_bar()
    try:
        with claim_out_dir(out_dir), phases() as shown:
            shown.phase(f"reading {len(files)} steps" + ("" if load.model is None else ", loading the trainer"))
            history = score_steps(files, out_dir, call, load, alarms=alarms, gate=gate, draw=draw_steps,
                                  progress=shown)
            shown.end()
    except ProbeError as e:
        fail(e)
    table = Table(title=f"{history.n_steps} steps (steps.csv); alarms (alarms.csv)")
    for col in ("alarm", "first step past it", "value"):
        table.add_column(col, justify="left" if col == "alarm" else "right")
    for a in history.alarms:
        table.add_row(a.condition.text, "never" if a.first_step is None else str(a.first_step),
                      "" if a.value is None else f"{a.value:.3e}")
    out.print(table)
    say(f"run: {out_dir}")
    exit_by(history.verdict)


def score_run(call, load, out_dir: Path, check=None, gate=None, rollouts_sha256: str | None = None):
    """Shared by score and rerun: claim --out, score, judge the gate, write; a ProbeError is one line and nothing
    is written."""
    from transformers.utils import logging as hf_logging

    from ..rundir import claim_out_dir
    from ..runs.manifest import runnable_command
    from ..runs.score import score_spec

    hf_logging.disable_progress_bar()
    try:
        with claim_out_dir(out_dir), phases() as shown:
            shown.phase("reading the rollouts, loading the trainer" + (" and the engine" if call.infer else ""))
            run = score_spec(call, load, check, shown, rollouts_sha256, gate)
            shown.end()
            run.manifest["command"] = runnable_command()
            run.manifest["phases"] = shown.timings
            verdict = judged(gate, run.manifest, [("run", run.summary)])
            run.write(out_dir)
    except ProbeError as e:
        fail(e)
    except MemoryError:  # below the rollout bounds, under a tighter limit than they were set for (or a model's size)
        fail(ProbeError(f"out of memory scoring {call.rollouts}: this process may not take the memory the scoring "
                         "needs (docs/reference/errors.md: what each rollout bound costs); raise its memory limit or split "
                         "the file (one RL step per file)"))
    return run, verdict


def print_score(run) -> None:
    from ..rollouts.causes import CAUSES

    s = run.summary
    table = Table(title=f"recorded ({run.batch.format}) vs trainer", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("response tokens scored", str(s["n_tokens"]))
    for key, label in [("mean_abs_dlogp", "mean |Δlogp| recorded vs trainer"),
                       ("rollout_vs_prefill_mean_abs_dlogp", "mean |Δlogp| recorded vs engine prefill"),
                       ("prefill_vs_train_mean_abs_dlogp", "mean |Δlogp| engine prefill vs trainer"),
                       ("max_abs_dlogp", "max |Δlogp|"), ("k3", "k3 KL estimate"), ("ratio_min", "min importance ratio"),
                       ("ratio_max", "max importance ratio"), ("ppo_clip_frac", "PPO-clipped fraction")]:
        if key in s:
            table.add_row(label, f"{s[key]:.3e}")
    table.add_row("recorded far from trainer", f"yes (> {s['far_bound']:.3g})" if s["recorded_far"] else "no")
    out.print(table)
    if s["likely_cause"]:
        out.print(f"likely cause ({s['likely_cause']}, a flag, not a verdict): {CAUSES[s['likely_cause']]}")
