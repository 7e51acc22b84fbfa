"""The `divergence-probe` command: a thin typer shell over the Python API (parse -> API -> rich).

Errors a user can fix (ProbeError) become one red line and exit code 2; anything else is a bug and keeps
its traceback. Set DP_RAISE_ERRORS=1 to get tracebacks for ProbeErrors too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sys
import typing
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table

from .errors import ProbeError, one_line

# Nothing torch-bound is imported here: the spec (spec.py and what it imports: torch, pandas) is read only when a
# command that takes its options from it is run or asked for its own --help (_LazyGroup), and every other import of
# the library is inside the function that needs it. So `divergence-probe --help` and the --help of rerun, report,
# score and make-model need no torch from this module (the package's __init__, which runs first, is another matter).


class _LazyGroup(typer.core.TyperGroup):
    """The app's click group. compare, ablate and rl take their options from spec fields, which means importing
    torch; they are listed (name and summary) from a placeholder, and built only when resolved to run or to show
    their own --help. Command order is _ORDER's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._listing = False
        built = dict(self.commands)
        self.commands = {}
        for name in _ORDER:
            if name in _LAZY:
                self.commands[name] = _placeholder(name, _LAZY[name][0])
            elif name in built:
                self.commands[name] = built.pop(name)
        self.commands.update(built)  # any command not in _ORDER, after the rest

    def get_command(self, ctx, cmd_name: str):
        command = self.commands.get(cmd_name)
        if getattr(command, "_placeholder", False) and not self._listing:
            command = self.commands[cmd_name] = _build_command(cmd_name, _LAZY[cmd_name][1]())
        return command

    def format_help(self, ctx, formatter) -> None:
        self._listing = True  # the list of commands reads the placeholders; nothing is built for it
        try:
            return super().format_help(ctx, formatter)
        finally:
            self._listing = False


_ORDER = ("compare", "ablate", "rerun", "report", "rl", "score", "make-model")
_LAZY: dict = {}  # name -> (docstring, function making the command's callback); filled where each command is defined


def _lazy_command(name: str, doc: str):
    """Register `name` with the app as a command whose callback (and so its spec-made options) the decorated function
    makes on first use; `doc` is the docstring the callback will have (the command list shows its first paragraph)."""
    def register(make):
        _LAZY[name] = (doc, make)
        return make
    return register


def _placeholder(name: str, doc: str):
    def command() -> None:
        pass

    command.__doc__ = doc
    placeholder = _build_command(name, command)
    placeholder._placeholder = True
    return placeholder


def _build_command(name: str, callback):
    """The click command typer makes of `callback`, as app.command(name) would."""
    single = typer.Typer(add_completion=False, rich_markup_mode=app.rich_markup_mode,
                         pretty_exceptions_short=app.pretty_exceptions_short)
    single.command(name)(callback)
    return typer.main.get_command(single)


app = typer.Typer(
    cls=_LazyGroup,
    add_completion=False,
    no_args_is_help=True,
    help="Find where vLLM and the transformers training stack round differently, layer by layer and token by token.",
)
console = Console(stderr=True, soft_wrap=True)  # soft_wrap: an error stays one line in a pipe or CI log (no 80-column wrap)
out = Console()

OutOpt = typer.Option(None, "--out", "-o", help="New or empty output folder. Default: runs/<date>-<time>-<microseconds>.")
VERBOSE = ("-v", "--verbose")


@app.callback()
def _app_options(verbose: bool = typer.Option(False, *VERBOSE, help="Show the libraries' own output (vLLM, transformers, "
                                          "torch: start-up logs, progress bars, warnings); by default stderr holds "
                                          "the tool's lines alone. DP_RAISE_ERRORS=1 implies it.")) -> None:
    if not (verbose or os.environ.get("DP_RAISE_ERRORS")):
        _quiet_libraries()


def _quiet_libraries() -> None:
    """The libraries' log levels, set where they read them: environment variables, read when a library is first
    imported and inherited by the processes it starts (vLLM's engine core, the engine workers), which a logger
    level set here would not reach. Set only where the user has not."""
    for name, value in (("VLLM_LOGGING_LEVEL", "ERROR"), ("TRANSFORMERS_VERBOSITY", "error"),
                        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TORCH_CPP_LOG_LEVEL", "ERROR")):
        os.environ.setdefault(name, value)
    if "transformers" in sys.modules:  # imported already (the API before the CLI): its level is read at import
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()


def _wants_verbose(argv: list[str]) -> bool:
    """-v/--verbose among the app's own options (those before the command), or DP_RAISE_ERRORS."""
    for arg in argv:
        if arg in VERBOSE:
            return True
        if not arg.startswith("-"):
            break
    return bool(os.environ.get("DP_RAISE_ERRORS"))


@contextlib.contextmanager
def _libraries_silenced():
    """While the command runs, file descriptor 2 points at the null device and the tool's console at the real stderr:
    what the libraries write there, from Python (tqdm bars such as vLLM's "Loading safetensors checkpoint shards",
    warnings, loggers) or from C++ (torch reads TORCH_CPP_LOG_LEVEL once, when it is imported, before any command
    runs), reaches no one, and an error stays the one line the tool prints. A traceback is printed after it ends."""
    sys.stderr.flush()
    real = os.fdopen(os.dup(2), "w", buffering=1, encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                     errors="replace")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    console.file = real
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(real.fileno(), 2)
        console.file = None  # back to whatever sys.stderr is
        real.close()


def _fail(error: ProbeError) -> None:
    if os.environ.get("DP_RAISE_ERRORS"):
        raise error
    console.print(f"[bold red]error:[/] {escape(one_line(error))}", highlight=False, markup=True)
    raise typer.Exit(error.exit_code)


def _progress() -> Progress:
    # transient: the bars are for a person watching; they leave no lines in a log, where an error stays one line (off
    # outside a terminal, where rich would still end them with an empty line)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("left"), TimeRemainingColumn(compact=True), console=console, transient=True,
                    disable=not console.is_terminal)


class _Phases:
    """One bar per long phase of a run (load, scoring, each noise floor, each ablate combination, each rl run), each
    with its elapsed time and, once it has a total, the time left. The API takes it as its progress callback:
    `(done, total)` calls move the current bar, `phase(name)` (compare.phase) ends it and starts the next. A phase
    that ended stays on screen, done, until the command ends (then all go: transient)."""

    def __init__(self, bar: Progress) -> None:
        self.bar, self.task, self.offset, self.scale = bar, None, 0, 1

    def phase(self, name: str, *, offset: int = 0, scale: int = 1, total: int | None = None) -> None:
        self.end()
        self.task = self.bar.add_task(name, total=total)
        self.offset, self.scale = offset, scale

    def __call__(self, done: int, total: int) -> None:
        if self.task is not None:
            self.bar.update(self.task, completed=done - self.offset, total=max(total // self.scale, 1))

    def note(self, text: str) -> None:
        """Replace the current bar's description (rl: the last step's reward and mismatch)."""
        if self.task is not None:
            self.bar.update(self.task, description=text)

    def end(self) -> None:
        """The current bar, done: a phase without counts (a load, a noise floor) fills its bar when it ends."""
        if self.task is not None:
            task = next(t for t in self.bar.tasks if t.id == self.task)
            total = task.total or max(task.completed, 1)
            self.bar.update(self.task, total=total, completed=total)
            self.bar.stop_task(self.task)
            self.task = None


@contextlib.contextmanager
def _phases():
    with _progress() as bar:
        yield _Phases(bar)


def _closing(out_dir: Path, report: bool, step) -> None:
    """The last lines of every run: its folder, its report (rendered now with --report, else the command that
    renders it) and the next command to try with why (next_steps.py), each on a line of its own to copy."""
    import shlex

    out.print(f"run: {out_dir}", highlight=False, markup=False, soft_wrap=True)
    if report:
        _write_report(out_dir)
    else:
        out.print(f"report: {shlex.join(['divergence-probe', 'report', str(out_dir)])}", highlight=False, markup=False,
                  soft_wrap=True)
    if step is not None:
        out.print(f"next: {shlex.join(step.argv)}", highlight=False, markup=False, soft_wrap=True)
        out.print(f"  why: {step.why}", highlight=False, markup=False, soft_wrap=True)


def _family(manifest: dict):
    """The model family a run's manifest names (what it cannot run: Family.unsupported), or None if unknown."""
    from .models import get_family

    model = manifest.get("model")
    try:
        return get_family(model.get("arch")) if isinstance(model, dict) else None
    except (ProbeError, KeyError, TypeError):
        return None


def _next_step(run):
    """A compare or ablate run's next command (next_steps.py)."""
    from .next_steps import after_ablate, after_compare

    family = _family(run.manifest)
    if run.spec.kind == "ablate":
        return after_ablate(run.spec, run.attribution_table, family)
    return after_compare(run.spec, run.summary, family)


def _print_summary(run) -> None:
    from .tables import NOISE_FLOORS, largest_noise_floor, worst_layer

    s = run.summary
    table = Table(title="vLLM vs transformers" if run.manifest["load"]["infer"] == "vllm" else "infer vs train", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("response tokens scored" if "k3" in s else "tokens scored", str(s["n_tokens"]))
    table.add_row("mean |Δlogp|", f"{s['mean_abs_dlogp']:.3e}")
    table.add_row("max |Δlogp|", f"{s['max_abs_dlogp']:.3e}")
    table.add_row("p99 |Δlogp|", f"{s['p99_abs_dlogp']:.3e}")
    table.add_row("mean KL(infer‖train)", f"{s['mean_kl']:.3e}")
    table.add_row("max KL", f"{s['max_kl']:.3e}")
    table.add_row("first inexact tap", s["first_inexact"])
    table.add_row(f"first tap over rel_l2 {run.threshold:g}", s["first_over_threshold"])
    worst = worst_layer(run.tap_stats)
    table.add_row("worst layer (resid_out rel_l2)", f"{worst[0]} ({worst[1]:.3e})" if worst else "not captured")
    for key, label in [("noise_infer_mean_abs_dlogp", "noise floor: infer alone vs batched"),
                       ("noise_train_mean_abs_dlogp", "noise floor: train alone vs batched"),
                       ("noise_train_kernel_mean_abs_dlogp", "noise floor: train, another SDPA kernel"),
                       ("noise_infer_engine_mode_mean_abs_dlogp", "noise floor: engine, other mode"),
                       ("noise_infer_tensor_parallel_mean_abs_dlogp", "noise floor: engine, tensor_parallel_size 1"),
                       ("noise_train_tensor_parallel_mean_abs_dlogp", "noise floor: train, unsharded (--train-tp 1)"),
                       ("tap_points_mean_abs_dlogp", "engine with vs without tap points"),
                       ("k3", "k3 KL estimate"), ("ratio_min", "min importance ratio"), ("ratio_max", "max importance ratio"),
                       ("ppo_clip_frac", "PPO-clipped fraction (numerics alone)"), ("ess", "effective sample size")]:
        if key in s:
            table.add_row(label, f"{s[key]:.3e}")
    if "dominant_factor" in s:  # generate mode: trainer/prefill, prefill/decode or decode/recorded
        table.add_row("largest factor of π_train/π_recorded", s["dominant_factor"])
    largest = largest_noise_floor(s)
    if largest is None:  # a mismatch means little without it; say how to get it
        table.add_row("noise floor", "not measured (--batch-invariance, --engine-noise)")
    elif largest[1] > 0:
        table.add_row("mismatch / largest noise floor",
                      f"{s['mean_abs_dlogp'] / largest[1]:.3g}x ({NOISE_FLOORS[largest[0]]})")
    _routing_rows(table, s)
    out.print(table)
    _print_graft(getattr(run, "graft_tables", {}))


def _routing_rows(table, s: dict) -> None:
    """A mixture-of-experts run: how often the stacks route a token differently, beside each stack's own rate under a
    batch change, and |Δlogp| of the tokens right after a flipped position against the others (routing.csv: per
    layer)."""
    if "frac_tokens_any_flip" not in s:
        return
    table.add_row("tokens routed differently (any layer)", f"{s['frac_tokens_any_flip']:.2%}")
    for side in ("infer", "train"):
        if f"noise_{side}_frac_tokens_any_flip" in s:
            table.add_row(f"routing noise floor: {side} alone vs batched", f"{s[f'noise_{side}_frac_tokens_any_flip']:.2%}")
    after, elsewhere = s["mean_abs_dlogp_after_flip"], s["mean_abs_dlogp_not_after_flip"]
    table.add_row("mean |Δlogp| after a flip / elsewhere",
                  "no flips" if after != after else f"{after:.3e} / {elsewhere:.3e}")  # NaN: no token after a flip


def _print_graft(tables: dict) -> None:
    """compare --graft: the local error per op family beside the propagated one (local_families.csv)."""
    families = tables.get("local_families.csv")
    if families is None:
        return
    table = Table(title="local error per op family (local_families.csv)")
    for column in ("family", "local rel_l2", "propagated rel_l2", "amplification"):
        table.add_column(column, justify="left" if column == "family" else "right")
    for row in families.itertuples():
        table.add_row(row.family, f"{row.local_rel_l2:.3e}", f"{row.propagated_rel_l2:.3e}", f"{row.amplification:.3g}")
    out.print(table)


def _cli_type(hint, default):
    """The typer type and default of a spec field: lists and objects are typed as text and parsed by the spec."""
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin in (tuple, list):
        return str, ",".join(default)
    if hint is dict:
        return Optional[str], None
    if args and type(None) in typing.get_args(hint):  # X | None
        return Optional[args[0]], default
    return hint, default


# compare's and ablate's --help panels, from each spec field's component (spec.COMPONENTS); LoadSpec's fields are
# split by name between the model, the engine (inference side) and the trainer, so a field added to a component
# lands in its panel without an edit here.
_PANELS = {"prompts": "Model and prompts", "capture": "Capture", "generate": "Generate mode",
           "align": "Region alignment", "ablate": "Ablation", None: "Output"}


def _panel(kind: str, component: str | None, name: str) -> str:
    """The --help panel of the option `name` (a flat name, spec.flat_fields) of spec component `component`."""
    if component == "load":
        if name.startswith("train"):
            return "Trainer"
        if name == "infer" or name.startswith("engine") or name == "batch_tokens":
            return "Engine"
        return "Model and prompts"
    if component == "align" and kind == "ablate":  # ablate's --side: where its combinations are aligned
        return "Ablation"
    return _PANELS.get(component, "Options")


def _options(kind: str) -> list[inspect.Parameter]:
    """One typer option per spec field a command of `kind` takes (spec.flat_fields): declared once, in spec.py."""
    from .spec import COMPONENTS, RunSpec, flag_of, flat_fields

    params = []
    for component, f, name in flat_fields(kind):
        owner = COMPONENTS[component] if component else RunSpec
        hint = typing.get_type_hints(owner)[f.name]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        cli_type, cli_default = _cli_type(hint, default)
        decls = [flag_of(f) if component else "--report"] + ([f.metadata["short"]] if f.metadata.get("short") else [])
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=cli_type,
                                        default=typer.Option(cli_default, *decls, help=f.metadata.get("help", ""),
                                                             rich_help_panel=_panel(kind, component, name))))
    out_opt = typer.Option(None, "--out", "-o", help=OutOpt.help, rich_help_panel=_PANELS[None])
    params.append(inspect.Parameter("out_dir", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path], default=out_opt))
    return params


def _command_doc(doc: str) -> str:
    summary, _, details = inspect.cleandoc(doc).partition("\n\n")
    return " ".join(summary.split()) + "\n\n" + details  # the summary is one paragraph in --help


def _spec_command(kind: str, doc: str, after):
    """A typer command whose options are the spec's fields for `kind`; it builds the RunSpec, runs it, writes it."""

    def command(out_dir: Optional[Path] = None, **flags) -> None:
        from .spec import spec_from_flat

        run, out_dir = _run(lambda: spec_from_flat(kind, **flags), out_dir)
        after(run)
        _closing(out_dir, run.spec.report, _next_step(run))

    params = _options(kind)
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = _command_doc(doc)
    command.__name__ = kind
    return command


def _run(make_spec, out_dir: Optional[Path], check=None, check_run=None):
    """Shared by compare, ablate and rerun: build (and so validate) the spec and check --out before anything
    loads, load once, run with a progress bar, write atomically. `check(source)` runs before the stacks load,
    `check_run(manifest)` on the finished run before it is written (rerun: were these the recorded inputs?). Any
    ProbeError on the way is one line and exit code 2, and nothing is written."""
    from transformers.utils import logging as hf_logging

    import divergence_probe as dp
    from .compare import load_run_prompts
    from .rundir import claim_out_dir, default_out_dir

    hf_logging.disable_progress_bar()  # transformers' per-load bars: the status line above says what is loading
    try:
        spec = make_spec()
        out_dir = out_dir or default_out_dir()
        with claim_out_dir(out_dir):  # held until the run is written: a second run aiming here fails at once
            if spec.load.infer == "vllm" and spec.load.engine_args:
                from .stacks.vllm.stack import check_engine_args

                check_engine_args(spec.load.engine_args, spec.load.engine)  # imports vLLM, starts no engine

            def before_stacks(source, tokenizer):  # seconds in: everything a bad input can break, before the loads
                if check is not None:
                    check(source)
                load_run_prompts(spec, tokenizer, source.max_model_len)

            with _phases() as phases:
                phases.phase("loading the model in transformers and the inference stack")
                probe = dp.load(spec=spec.load, before_stacks=before_stacks, taps=spec.capture.taps, plan_for=spec)
                run = probe.run(spec, phases)
                phases.end()
            if check_run is not None:
                check_run(run.manifest)
            run.manifest["command"] = sys.argv
            run.write(out_dir)
    except ProbeError as e:
        _fail(e)
    return run, out_dir


_COMPARE_DOC = _command_doc("""Load the same weights in vLLM and transformers, feed both the same token ids, and diff every tap of
    every decoder layer and every token's logprob.

    Writes manifest.json, prompts.jsonl, tokens.csv, layers.csv and summary.csv (see README for columns).
    """)
_ABLATE_DOC = _command_doc("""Rerun compare with every combination of aligned regions (RoPE, SwiGLU, residual RMSNorm) and attribute
    the vLLM-vs-transformers mismatch to regions with Shapley values and bootstrap intervals.

    Writes compare's files with a combo column, plus ablation.csv (one row per combination) and
    attribution.csv (one row per region, and what remains with all aligned).
    """)


@_lazy_command("compare", _COMPARE_DOC)
def _compare_command():
    return _spec_command("compare", _COMPARE_DOC, _print_summary)


@_lazy_command("ablate", _ABLATE_DOC)
def _ablate_command():
    return _spec_command("ablate", _ABLATE_DOC, _print_ablation)


@app.command()
def rerun(
    run_dir: Path = typer.Argument(..., help="A run folder written by compare, ablate or score (its manifest.json)."),
    out_dir: Optional[Path] = OutOpt,
    report: bool = typer.Option(False, "--report", help="Render OUT/report after the run is written."),
    allow_engine_arg: Optional[list[str]] = typer.Option(
        None, "--allow-engine-arg", help="Replay this engine arg of the manifest although it is not one rerun replays "
        "without asking (see README 'rerun'); repeatable. Only for a run folder whose maker you trust."),
) -> None:
    """Run again exactly what a run folder's manifest recorded (its spec), into a new folder.

    The prompt files (of a score run: the rollout file) and the model's config must be the ones the run used
    (their sha256 are checked). A manifest is untrusted data: every field is checked as the CLI checks its flags,
    engine args that could load or run code are refused unless --allow-engine-arg names them, and what will run is
    shown before anything loads.
    """
    from .replay import check_replayable, describe
    from .rundir import MANIFEST, default_out_dir, read_run

    where = f"{run_dir}/{MANIFEST}"
    try:
        manifest = read_run(run_dir).manifest  # refuses a cut or changed run folder, and files outside it
    except ProbeError as e:
        _fail(e)
    target = out_dir or default_out_dir()
    if manifest.get("kind") == "score":
        _rerun_score(manifest, run_dir, where, target, report)
        return

    def make_spec():
        if "spec" not in manifest:
            raise ProbeError(f"{run_dir} was written before runs recorded their spec; re-run its `command` "
                             "from manifest.json instead")
        from .spec import RunSpec

        try:
            spec = dataclasses.replace(RunSpec.from_dict(manifest["spec"]), report=report)
        except ProbeError as e:
            raise ProbeError(f"{where}: {e}") from None
        check_replayable(spec, allow_engine_arg or (), where)
        from .compare import prompts_path

        prompts = prompts_path(spec)
        if prompts.exists() and not (prompts.is_dir() or prompts.is_file()):
            raise ProbeError(f"{where}: spec.prompts.prompts {prompts} is not a file or folder (a pipe or device would "
                             "block or never end); point it at the prompt files the run used")
        recorded_spec[:] = [spec]
        for line in describe(spec, target):  # before anything loads: what this folder makes the tool run
            out.print(line, highlight=False, markup=False, soft_wrap=True)
        return spec

    def same_prompts(hashes: dict) -> None:
        compared = manifest.get("compare")
        recorded_prompts = compared.get("prompt_files_sha256") if isinstance(compared, dict) else None
        if not isinstance(recorded_prompts, dict):
            raise ProbeError(f"{run_dir}/manifest.json lacks the model or prompt hashes a rerun checks; re-run its "
                             "`command` instead")
        if hashes != recorded_prompts:
            from .compare import prompts_path

            raise ProbeError(f"the prompt files under {prompts_path(recorded_spec[0])} changed since {run_dir} was "
                             "made; restore them")

    def check(source):  # before anything loads: fails in seconds
        from .compare import prompts_path
        from .prompts import file_hashes

        same_prompts(file_hashes(prompts_path(recorded_spec[0])))  # the files this rerun reads, found as the run did
        _same_model(manifest, source, run_dir, "compare")

    def check_run(made: dict) -> None:  # the hashes of the bytes the run read: a file swapped since `check` is caught
        same_prompts(made["compare"]["prompt_files_sha256"])

    recorded_spec: list = []
    run, out_dir = _run(make_spec, target, check, check_run)
    (_print_ablation if run.spec.kind == "ablate" else _print_summary)(run)
    _closing(out_dir, report, _next_step(run))


def _same_model(manifest: dict, source, run_dir: Path, command: str) -> None:
    """rerun re-makes a run only on the checkpoint it was made with: the model's config.json has the recorded
    sha256."""
    model = manifest.get("model")
    want = model.get("config_sha256") if isinstance(model, dict) else None
    if not isinstance(want, str):
        raise ProbeError(f"{run_dir}/manifest.json lacks the model hash a rerun checks; re-run its `command` instead")
    have = source.config_sha256
    if want != have:
        raise ProbeError(f"the model's config.json changed since {run_dir} was made (sha256 {have[:12]}… "
                         f"vs {want[:12]}…); point --model of a new {command} at the original checkpoint")


def _rerun_score(manifest: dict, run_dir: Path, where: str, out_dir: Path, report: bool) -> None:
    """rerun of a score run folder: its recorded ScoreSpec and LoadSpec, checked, shown, then scored again."""
    from .next_steps import after_score
    from .replay import describe_score, recorded_score

    try:
        call, load, rollouts_sha256 = recorded_score(manifest, where)
    except ProbeError as e:
        _fail(e)
    for line in describe_score(call, load, out_dir):  # before anything loads: what this folder makes the tool run
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    run = _score_run(call, load, out_dir, lambda source: _same_model(manifest, source, run_dir, "score"),
                     rollouts_sha256)
    _print_score(run)
    _closing(out_dir, report, after_score(call, load, run.summary))


def _print_ablation(run) -> None:
    metric = run.spec.ablate.metric
    combos = run.ablation_table.sort_values(metric, kind="stable")
    table = Table(title=f"ablation ({run.spec.align.side}), sorted by {metric}")
    for col in ("combo", metric, "mean_abs_dlogp", "first_inexact"):
        table.add_column(col, justify="left" if col in ("combo", "first_inexact") else "right")
    for row in combos.itertuples():
        table.add_row(row.combo, f"{getattr(row, metric):.3e}", f"{row.mean_abs_dlogp:.3e}", row.first_inexact)
    out.print(table)
    attr = Table(title=f"attribution of the reduction in {metric}")
    for col in ("region", "shapley", "share", f"{run.spec.ablate.ci_level:.0%} CI", "main effect", "leave-one-out"):
        attr.add_column(col, justify="left" if col == "region" else "right")
    for row in run.attribution_table.itertuples():
        attr.add_row(row.region, f"{row.shapley:.3e}", f"{row.share:.1%}", f"[{row.ci_low:.2e}, {row.ci_high:.2e}]",
                     f"{row.main_effect:.3e}", f"{row.leave_one_out:.3e}")
    out.print(attr)


@app.command("report")
def report_command(
    run_dir: Path = typer.Argument(..., help="A run folder (the --out of compare, ablate, score or rl)."),
    fmt: str = typer.Option("md", "--format", "-f", help="md (report.md + PNG/PDF figures), html (one self-contained report.html) or latex (report.tex, booktabs tables, PDF figures)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="New or empty folder, or one holding a previous report (replaced). Default: RUN_DIR/report."),
) -> None:
    """Render a run folder as a report a reader understands without the tool: setup, headline numbers,
    first divergence, tables and figures (error growth across layers, Δlogprob, KL by position, attribution).
    """
    _write_report(run_dir, out_dir, fmt)


def _write_report(run_dir: Path, out_dir: Optional[Path] = None, fmt: str = "md") -> None:
    from .reports import write_report

    try:
        with console.status("rendering the report…"):
            if (Path(run_dir) / "rl.csv").is_file():  # an rl run: its own report (figures of reward and mismatch)
                from .reports.rl import write_rl_report

                path = write_rl_report(run_dir, out_dir, fmt=fmt)
            else:
                path = write_report(run_dir, out_dir, fmt=fmt)
    except ProbeError as e:
        _fail(e)
    out.print(f"report: {path}")


def _rl_options() -> list[inspect.Parameter]:
    """One typer option per RLSpec field (declared once, in rl/spec.py); a tuple field is a repeatable flag."""
    from .rl.spec import RLSpec
    from .spec import flag_of

    hints = typing.get_type_hints(RLSpec)
    params = []
    for f in dataclasses.fields(RLSpec):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if typing.get_origin(hints[f.name]) is tuple:
            cli_type, cli_default = Optional[list[str]], None
        else:
            cli_type, cli_default = _cli_type(hints[f.name], default)
        decls = [flag_of(f)] + ([f.metadata["short"]] if f.metadata.get("short") else [])
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=cli_type,
                                        default=typer.Option(cli_default, *decls, help=f.metadata.get("help", ""))))
    params.append(inspect.Parameter("report", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
        False, "--report", help="After the run, render OUT/report (report.md, reward and mismatch figures).")))
    params.append(inspect.Parameter("out_dir", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path], default=OutOpt))
    return params


def rl_command(out_dir: Optional[Path] = None, report: bool = False, **flags) -> None:
    from transformers.utils import logging as hf_logging

    from . import rl
    from .next_steps import after_rl
    from .rundir import default_out_dir

    hf_logging.disable_progress_bar()
    try:
        spec = rl.RLSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in flags.items() if v is not None
                            or k in ("model", "prompts", "reward")})
        out_dir = out_dir or default_out_dir()
        runs = len(spec.settings) * len(spec.seed_list)
        with _phases() as phases:
            phases.phase("loading the engine and the trainer")
            current: list = []

            def progress(row: dict, done: int, total: int) -> None:  # one bar per (setting, seed) run, of its steps
                if current != [(row["setting"], row["seed"])]:
                    current[:] = [(row["setting"], row["seed"])]
                    phases.phase(f"{row['setting']} seed {row['seed']}", offset=done - 1, scale=runs)
                phases(done, total)
                phases.note(f"{row['setting']} seed {row['seed']} step {row['step']}: reward {row['reward_mean']:.2f}, "
                            f"|Δlogp| {row['mean_abs_dlogp']:.2e}")

            result = rl.run(spec, out_dir, progress)
            phases.end()
    except ProbeError as e:
        _fail(e)
    table = Table(title="rl: first -> last steps (rl_summary.csv)")
    for col in ("setting", "seed", "reward", "mean |Δlogp|", "s/step", "overhead"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for row in result.summary.itertuples():
        table.add_row(row.setting, str(row.seed), f"{row.reward_start:.2f} -> {row.reward_end:.2f}",
                      f"{row.mean_abs_dlogp_start:.2e} -> {row.mean_abs_dlogp_end:.2e}", f"{row.s_per_step:.1f}",
                      f"{row.overhead_frac:.0%}")
    out.print(table)
    _closing(out_dir, report, after_rl(spec, _family(result.manifest)))


_RL_DOC = """A small GRPO loop: vLLM samples, a verifiable reward scores, transformers updates, the weights are
    pushed into the running engine and verified every step (per-tensor checksums, stale prefix-cache probe).

    Writes rl.csv (one row per step, flushed as it goes), rl_summary.csv and manifest.json. With several
    --setting values or --seeds > 1, every (setting, seed) run shares one engine (weights reset between runs).
    """
rl_command.__doc__ = _RL_DOC


@_lazy_command("rl", _RL_DOC)
def _rl_command():
    rl_command.__signature__ = inspect.Signature(_rl_options())  # RLSpec's fields: imports rl/ (torch)
    return rl_command


@app.command("score")
def score_command(
    rollouts: Path = typer.Argument(..., help="Rollout file your RL run recorded: .jsonl, .jsonl.gz or .parquet."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="The checkpoint the rollouts were sampled from "
                                        "(folder or hub id). Default: the built-in tiny trained Qwen3."),
    fmt: str = typer.Option("auto", "--format", help="auto (from the field names), verl, openrlhf, slime, trl or "
                            "generic."),
    fields: Optional[str] = typer.Option(None, "--fields", help="Generic format's columns: prompt_ids=COL,"
                                         "response_ids=COL,logprobs=COL[,group=COL]."),
    infer: Optional[str] = typer.Option(None, "--infer", help="vllm: also re-score every sequence with the engine's "
                                        "prefill (logprob_prefill; the three-way split)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="The run's sampling temperature: tests "
                                                "whether the recorded logprobs are tempered ones."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="The trainer's dtype: bfloat16, float16 or float32."),
    device: str = typer.Option("auto", "--device", help="auto (cuda when present), cpu or cuda."),
    train_attn: str = typer.Option("sdpa", "--train-attn", help="transformers attention: sdpa, eager or "
                                   "flash_attention_2."),
    train_sdpa: str = typer.Option("auto", "--train-sdpa", help="SDPA kernel: auto, math, flash, efficient or cudnn."),
    clip_eps: float = typer.Option(0.2, "--clip-eps", help="PPO clip band [1-eps, 1+eps] for the ratio metrics."),
    tis_cap: float = typer.Option(2.0, "--tis-cap", help="TIS truncation cap C (token MIS band [1/C, C])."),
    out_dir: Optional[Path] = OutOpt,
) -> None:
    """Score the rollouts your RL run recorded with the training stack, as generate mode's trainer side does.

    Writes generate mode's files (tokens.csv with logprob_rollout beside logprob_train, buckets.csv, summary.csv
    with the RL metrics, manifest.json with the file's sha256 and the format read). See README "score".
    """
    from .next_steps import after_score
    from .rundir import default_out_dir
    from .score import ScoreSpec
    from .spec import LoadSpec

    try:
        call = ScoreSpec(rollouts=str(rollouts.absolute()), fmt=fmt, fields=fields, infer=infer,
                         temperature=temperature, clip_eps=clip_eps, tis_cap=tis_cap)
        load = LoadSpec(model=model, dtype=dtype, device=device, train_attn=train_attn, train_sdpa=train_sdpa)
    except ProbeError as e:
        _fail(e)
    out_dir = out_dir or default_out_dir()
    run = _score_run(call, load, out_dir)
    _print_score(run)
    _closing(out_dir, False, after_score(call, load, run.summary))


def _score_run(call, load, out_dir: Path, check=None, rollouts_sha256: str | None = None):
    """Shared by score and rerun: claim --out, score, write; a ProbeError is one line and nothing is written."""
    from transformers.utils import logging as hf_logging

    from .rundir import claim_out_dir
    from .score import score_spec

    hf_logging.disable_progress_bar()
    try:
        with claim_out_dir(out_dir), _phases() as phases:
            phases.phase("reading the rollouts, loading the trainer" + (" and the engine" if call.infer else ""))
            run = score_spec(call, load, check, phases, rollouts_sha256)
            phases.end()
            run.manifest["command"] = sys.argv
            run.write(out_dir)
    except ProbeError as e:
        _fail(e)
    return run


def _print_score(run) -> None:
    from .rollouts.causes import CAUSES

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


@app.command("make-model")
def make_model(
    out_dir: Path = typer.Argument(..., help="New folder for the checkpoint."),
    arch: Optional[str] = typer.Option(None, "--arch", help="qwen2, qwen3 or qwen3_moe; default: the preset's own (tiny: qwen3)."),
    preset: str = typer.Option("tiny", "--preset", help="tiny (a few MB; with --arch qwen3_moe: 32 experts, top-4), qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, qwen2.5-14b, qwen2.5-32b, qwen3-0.6b, qwen3-1.7b or qwen3-30b-a3b (real shapes, random weights)."),
    seed: int = typer.Option(0, "--seed", help="Weight seed; same seed, same bytes."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing non-empty folder."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Number of decoder layers; default: the preset's. Cuts a real shape's depth to fit one device."),
) -> None:
    """Write a Hugging Face-format Qwen checkpoint with seeded random weights and a real BPE tokenizer.

    Real weights need a network; these models let you run everything offline, at real shapes.
    """
    from .modelzoo import make_model as build

    try:
        with console.status(f"building {preset} ({arch})…" if arch else f"building {preset}…"):
            path = build(out_dir, arch=arch, preset=preset, seed=seed, overwrite=overwrite, num_layers=layers)
    except ProbeError as e:
        _fail(e)
    out.print(f"model: {path}")


def main() -> None:
    """The console entry point: SIGTERM stops a command like Ctrl-C (its cleanups run), then one line and 128+N;
    the libraries' own output is silenced unless -v (`_libraries_silenced`)."""
    from .signals import Stopped, stop_on_signals

    quiet = contextlib.nullcontext() if _wants_verbose(sys.argv[1:]) else _libraries_silenced()
    try:
        with stop_on_signals(), quiet:
            app()
    except Stopped as e:
        console.print(f"[bold red]stopped:[/] {e.name} received; nothing was left half-written", highlight=False)
        raise SystemExit(e.code) from None
