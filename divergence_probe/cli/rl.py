"""`rl`: an RLSpec from the flags (every option a field of it or of its parts: options.rl_flags), run by rl.run with one
bar per (setting, seed) run, its summary on stdout."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..errors import ProbeError
from .console import fail, out, phases, say
from .options import command_doc, generated, keyword, out_parameter, parameters, rl_flags
from .runner import closing, family_of


def rl_command(out_dir: Optional[Path] = None, report: bool = False, **flags) -> None:
    from ..rundir import default_out_dir
    from ..spec.rl import rl_spec

    try:
        spec = rl_spec(**{k: tuple(v) if isinstance(v, list) else v for k, v in flags.items() if v is not None
                          or k in ("model", "prompts", "reward")})
    except ProbeError as e:
        fail(e)
    rl_run(spec, out_dir or default_out_dir(), report)


def rl_run(spec, out_dir: Path, report: bool, check=None) -> None:
    """Shared by rl and rerun: run the experiment with one bar per (setting, seed) run, print its summary and the
    closing lines; a ProbeError is one line (rl/experiment.py leaves no folder, or saves the rows it made)."""
    from transformers.utils import logging as hf_logging

    from .. import rl
    from ..runs.next_steps import after_rl

    hf_logging.disable_progress_bar()
    try:
        runs = len(spec.settings) * len(spec.seed_list)
        with phases() as shown:
            shown.phase("loading the engine and the trainer")
            current: list = []

            def progress(row: dict, done: int, total: int) -> None:  # one bar per (setting, seed) run, of its steps
                if current != [(row["setting"], row["seed"])]:
                    current[:] = [(row["setting"], row["seed"])]
                    shown.phase(f"{row['setting']} seed {row['seed']}", offset=done - 1, scale=runs)
                shown(done, total)
                shown.note(f"{row['setting']} seed {row['seed']} step {row['step']}: reward {row['reward_mean']:.2f}, "
                            f"|Δlogp| {row['mean_abs_dlogp']:.2e}")
                if done == total:  # the last run's phase ends with its last step, before the manifest is written
                    shown.end()

            result = rl.run(spec, out_dir, progress, check=check,
                            recorded=lambda: {"phases": shown.timings})
            shown.end()
    except ProbeError as e:
        fail(e)
    print_rl_summary(result.summary)
    closing(out_dir, report, after_rl(spec, family_of(result.manifest), result.summary))


def print_rl_summary(summary) -> None:
    """rl_summary.csv as a table: each run's mean reward and mismatch over its first steps and over its last ones,
    the steps named (numerics/rl_summary.py window: the two never overlap)."""
    import pandas as pd

    from ..numerics.collapse import GROWTH
    from ..numerics.rl_summary import comparison_words, window_label

    table = Table(title="rl: the first steps against the last (rl_summary.csv)")
    for col in ("setting", "seed", "steps averaged", "reward", "mean |Δlogp|", "floors at step 1 (engine, trainer)",
                "collapsed", "s/step", "overhead"):
        table.add_column(col, justify="left" if col in ("setting", "steps averaged") else "right")
    for row in summary.itertuples():
        table.add_row(row.setting, str(row.seed), window_label(1, row.steps, row.window),
                      f"{row.reward_start:.2f} -> {row.reward_end:.2f}",
                      f"{row.mean_abs_dlogp_start:.2e} -> {row.mean_abs_dlogp_end:.2e}",
                      f"{row.floor_engine_batch:.2e}, {row.floor_train_batch:.2e}",
                      "no" if pd.isna(row.collapsed_at_step) else f"at step {row.collapsed_at_step}",
                      f"{row.s_per_step:.1f}", f"{row.overhead_frac:.0%}")
    out.print(table)
    fell = summary[summary.collapsed_at_step.notna()]
    out.print(f"collapse (reward below its start to the end while k3 or the |Δlogp| tail grew {GROWTH:g}x; "
              f"docs/reference/rl.md): {len(fell)} of {len(summary)} runs"
              + "".join(f"; {r.setting} seed {r.seed} at step {r.collapsed_at_step}" for r in fell.itertuples()))
    for line in comparison_words(summary):
        say(line)


RL_DOC = command_doc("""A small GRPO loop: vLLM samples, a verifiable reward scores, transformers updates, and the
    new weights are pushed into the running engine and verified every step.

    The push is vLLM's in-place reload (no restart). The check compares every tensor the engine computes with, exactly
    and on the device, with the trainer's; a stale prefix-cache probe checks that no KV block from before the push is
    served. --audit-every N adds a sha256 comparison of the weights on the host.

    Writes rl.csv (one row per step, flushed as it goes), rl_summary.csv and manifest.json. With several
    --setting values or --seeds > 1, every (setting, seed) run shares one engine (weights reset between runs).
    Each run's first step measures both stacks' noise floors (each against itself, alone against batched); the closing lines
    say which runs collapsed (reward below its start for good while the mismatch grew tenfold: docs/reference/rl.md).

    Examples:
      divergence-probe rl --steps 20 --report
      divergence-probe rl --setting none --setting rope,swiglu,rmsnorm --seeds 2
      divergence-probe rl --setting none --setting train:correction=tis --setting train:kernels=liger
      divergence-probe rl --model M --reward letters --engine compiled
      divergence-probe rl --model M --setting none --setting routing
    """)


def make_rl_command():
    """rl's typer command: RLSpec's fields, then --report and --out."""
    params = [*parameters(rl_flags()),
              keyword("report", bool, typer.Option(False, "--report", help="After the run, render OUT/report "
                                                   "(report.md, reward and mismatch figures).")),
              out_parameter()]
    return generated(rl_command, params, RL_DOC, "rl_command")
