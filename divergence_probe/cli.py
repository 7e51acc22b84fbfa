"""The `divergence-probe` command: a thin typer shell over the Python API (parse -> API -> rich).

Errors a user can fix (ProbeError) become one red line and exit code 2; anything else is a bug and keeps
its traceback. Set DP_RAISE_ERRORS=1 to get tracebacks for ProbeErrors too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import os
import sys
import threading
import time
import typing
from pathlib import Path
from typing import Optional

import typer
from typer._click import exceptions as click  # typer's own copy of click: its usage errors
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Column, Table

from . import timings
from .errors import ProbeError, docs_at_hand, one_line
from .quiet import quiet_libraries, show_libraries
from .versions import ALLOW_HELP

# Nothing torch-bound is imported here: the spec (spec/ and what it imports: torch, pandas) is read only when a
# command that takes its options from it is run or asked for its own --help (_LazyGroup), and every other import of
# the library is inside the function that needs it. So `divergence-probe --help` and the --help of rerun, report,
# score and make-model need no torch from this module (the package's __init__, which runs first, is another matter).


def _untyped_flags(params: list) -> list:
    """An on/off flag takes no value, so --help shows no type beside it (typer would show `<bool>`)."""
    for param in params:
        if param.param_type_name == "option" and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class _Command(typer.core.TyperCommand):
    """Every command's click class: flags shown without a type."""

    def get_params(self, ctx):
        return _untyped_flags(super().get_params(ctx))


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

    def get_params(self, ctx):
        return _untyped_flags(super().get_params(ctx))

    def format_help(self, ctx, formatter) -> None:
        self._listing = True  # the list of commands reads the placeholders; nothing is built for it
        try:
            return super().format_help(ctx, formatter)
        finally:
            self._listing = False


_ORDER = ("compare", "ablate", "remedies", "rerun", "report", "diff", "rl", "score", "make-model")
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
    single.command(name, cls=_Command)(callback)
    return typer.main.get_command(single)


app = typer.Typer(
    cls=_LazyGroup,
    add_completion=False,
    no_args_is_help=True,
    help="Find where vLLM and the transformers training stack round differently, layer by layer and token by token.",
)
# Outside a terminal (a pipe, a CI log, a file) the tables take their natural width: a width a log does not have would
# cut numbers and names (`1.18e…`). In one, COLUMNS (or the terminal's size) rules, but a width that cannot hold a
# table's row (COLUMNS=0 printed nothing at all, errors included) is raised to NARROWEST.
UNCUT, NARROWEST = 100_000, 40


def columns_for(stream) -> int:
    """The width to draw at on `stream`: UNCUT unless it is a terminal; there COLUMNS when it is a whole number,
    else the terminal's own width, at least NARROWEST either way."""
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # no stream, or a closed one
        terminal = False
    if not terminal:
        return UNCUT
    columns = os.environ.get("COLUMNS", "").strip()
    if not columns.isdigit() or int(columns) == 0:
        try:
            columns = os.get_terminal_size(stream.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 80
    return max(int(columns), NARROWEST)


class _Console(Console):
    """A rich console whose width is `columns_for` its stream, asked at every print (the stream can be replaced)."""

    @property
    def size(self):
        from rich.console import ConsoleDimensions

        return ConsoleDimensions(columns_for(self.file), super().size.height)

    @size.setter
    def size(self, new_size) -> None:
        Console.size.fset(self, new_size)


console = _Console(stderr=True, soft_wrap=True)  # soft_wrap: an error stays one line in a pipe or CI log (no wrap)
out = _Console()

OutOpt = typer.Option(None, "--out", "-o", help="New or empty output folder. Default: runs/<date>-<time>-<microseconds>.")
FAIL_IF_HELP = ("Exit 1 (after writing everything) when METRIC OP VALUE holds, e.g. mean_kl>1e-3, "
                "mismatch_over_floor>2, first_inexact!=attn_core@0 (OP: > >= < <= == !=; METRIC: a summary column); "
                "repeatable. The verdict is recorded in manifest.json (gate).")
VERBOSE = ("-v", "--verbose")


@app.callback()
def _app_options(verbose: bool = typer.Option(False, *VERBOSE, help="Show the libraries' own output (vLLM, transformers, "
                                          "torch: start-up logs, progress bars, warnings); by default stderr holds "
                                          "the tool's lines alone. DP_RAISE_ERRORS=1 implies it.")) -> None:
    if verbose or os.environ.get("DP_RAISE_ERRORS"):
        show_libraries()
    else:
        quiet_libraries()


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
    console.print(f"[bold red]error:[/] {escape(docs_at_hand(one_line(error)))}", highlight=False, markup=True)
    raise typer.Exit(error.exit_code)


def _progress() -> Progress:
    # transient: the bars are for a person watching; they leave no lines in a log, where an error stays one line (off
    # outside a terminal, where rich would still end them with an empty line, and _Phases writes lines instead).
    # The description takes the width the rest leaves (cut with an ellipsis): on a narrow terminal the counts and the
    # times stay whole.
    return Progress(TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
                    BarColumn(bar_width=12), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"),
                    TimeRemainingColumn(compact=True), console=console, transient=True, expand=True,
                    disable=not console.is_terminal)


class _Phases:
    """One bar per long phase of a run (load, scoring, each noise floor, each ablate combination, each rl run), each
    with its elapsed time and, once it has a total, the time left. The API takes it as its progress callback:
    `(done, total)` calls move the current bar, `phase(name)` (compare.phase) ends it and starts the next. A phase
    that ended stays on screen, done, until the command ends (then all go: transient).

    Outside a terminal (a CI log, a batch job, `| tee`) there are no bars, so a run would say nothing for minutes:
    a phase still running after LOG_AFTER seconds writes a line saying it runs, and one with its duration when it
    ends, on stderr: stdout holds the results alone, to pipe or parse, and an error's line still comes last (the
    phases end before it). `timings` (phase name -> seconds) goes into the run's manifest either way."""

    LOG_AFTER = 10.0

    def __init__(self, bar: Progress) -> None:
        self.bar, self.task, self.offset, self.scale = bar, None, 0, 1
        self.log = not bar.console.is_terminal
        self.timings: dict[str, float] = {}
        self.name, self.described, self.started = "", "", 0.0
        self.announced, self.timer, self.lock = False, None, threading.Lock()
        self.talking = False  # a phase line was written: the log follows the run, every later phase writes its lines

    def phase(self, name: str, *, offset: int = 0, scale: int = 1, total: int | None = None) -> None:
        self.end()
        self.task = self.bar.add_task(name, total=total)
        self.offset, self.scale = offset, scale
        self.name, self.described, self.started, self.announced = name, name, time.monotonic(), False
        if self.log and self.talking:  # a short phase after a long one (a noise floor after the scoring) is shown too
            self._announce(self.task)
        elif self.log:  # the line comes while the phase runs, from a timer: a log shows what a long run is doing
            self.timer = threading.Timer(self.LOG_AFTER, self._announce, args=(self.task,))
            self.timer.daemon = True
            self.timer.start()

    def __call__(self, done: int, total: int) -> None:
        if self.task is not None:
            self.bar.update(self.task, completed=done - self.offset, total=max(total // self.scale, 1))

    def note(self, text: str) -> None:
        """Replace the current bar's description (rl: the last step's reward and mismatch)."""
        if self.task is not None:
            self.bar.update(self.task, description=text)
            self.described = text

    def end(self) -> None:
        """The current bar, done: a phase without counts (a load, a noise floor) fills its bar when it ends."""
        if self.task is not None:
            task = next(t for t in self.bar.tasks if t.id == self.task)
            total = task.total or max(task.completed, 1)
            self.bar.update(self.task, total=total, completed=total)
            self.bar.stop_task(self.task)
            self.task = None
            seconds = time.monotonic() - self.started
            self.timings[self.name] = round(self.timings.get(self.name, 0.0) + seconds, 6)
            self.stop_timer()
            with self.lock:
                if self.log and (seconds >= self.LOG_AFTER or self.announced):
                    if not self.announced:  # the timer had not yet written its line
                        self._line(f"{self.name}…")
                    self._line(f"{self.described}: done in {seconds:.1f} s")
                self.announced = True  # the task ended: a late timer writes nothing

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _announce(self, task) -> None:
        with self.lock:
            if self.task == task and not self.announced:
                self.announced = True
                self._line(f"{self.name}…")

    def _line(self, text: str) -> None:
        self.talking = True
        console.print(text, highlight=False, markup=False, soft_wrap=True)  # stderr: stdout holds the results alone


@contextlib.contextmanager
def _phases():
    with _progress() as bar:
        phases = _Phases(bar)
        try:
            yield phases
        finally:  # an error's line comes after the block: no phase line may follow it
            phases.stop_timer()


def _closing(out_dir: Path, report: bool, step) -> None:
    """The last lines of every run: its folder, its report (rendered now with --report, else the command that
    renders it) and the next command to try with why (runs/next_steps.py), each on a line of its own to copy."""
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
    """A compare or ablate run's next command (runs/next_steps.py)."""
    from .runs.next_steps import after_ablate, after_compare

    family = _family(run.manifest)
    if run.spec.kind == "ablate":
        return after_ablate(run.spec, run.attribution_table, family)
    return after_compare(run.spec, run.summary, family)


def _print_summary(run) -> None:
    from .numerics.noise_verdict import LEVEL, RATIO, in_words
    from .numerics.shapley import MIN_PROMPTS
    from .numerics.tables import FLOOR_KINDS, NOISE_FLOORS, NOT_CAPTURED, largest_noise_floor, worst_layer

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
    if s["first_inexact"] != NOT_CAPTURED:  # --taps none: no tap rows to show
        table.add_row("first inexact tap", s["first_inexact"])
        table.add_row(f"first tap over rel_l2 {run.threshold:g}", s["first_over_threshold"])
    worst = worst_layer(run.tap_stats)
    if worst:
        table.add_row("worst layer (resid_out rel_l2)", f"{worst[0]} ({worst[1]:.3e})")
    # each floor labelled by its kind (tables.FLOOR_KINDS): "noise floor: ..." or "systematic floor: ..."
    for key, label in [("noise_infer_mean_abs_dlogp", "infer alone vs batched"),
                       ("noise_train_mean_abs_dlogp", "train alone vs batched"),
                       ("noise_train_kernel_mean_abs_dlogp", "train, another SDPA kernel"),
                       ("noise_infer_engine_mode_mean_abs_dlogp", "engine, other mode"),
                       ("noise_infer_tensor_parallel_mean_abs_dlogp", "engine, tensor_parallel_size 1"),
                       ("noise_train_tensor_parallel_mean_abs_dlogp", "train, unsharded (--train-tp 1)"),
                       ("tap_points_mean_abs_dlogp", "engine with vs without tap points"),
                       ("k3", "k3 KL estimate"), ("ratio_min", "min importance ratio"), ("ratio_max", "max importance ratio"),
                       ("ppo_clip_frac", "PPO-clipped fraction (numerics alone)"), ("ess", "effective sample size")]:
        if key in s:
            table.add_row(f"{FLOOR_KINDS[key]} floor: {label}" if key in FLOOR_KINDS else label, f"{s[key]:.3e}")
    if "dominant_factor" in s:  # generate mode: trainer/prefill, prefill/decode or decode/recorded
        table.add_row("largest factor of π_train/π_recorded", s["dominant_factor"])
    largest = largest_noise_floor(s)
    if largest is None:  # a mismatch means little without it; say how to get it
        table.add_row("noise floor", "not measured (--batch-invariance, --engine-noise)")
    else:
        if largest[1] > 0:
            low, high = s[RATIO + "_ci_low"], s[RATIO + "_ci_high"]
            interval = (f"{LEVEL:.0%} CI [{low:.3g}x, {high:.3g}x]" if low == low and high == high
                        else f"no interval (fewer than {MIN_PROMPTS} prompts)")
            table.add_row("mismatch / largest floor",
                          f"{s[RATIO]:.3g}x, {interval} ({NOISE_FLOORS[largest[0]]}: {FLOOR_KINDS[largest[0]]})")
        table.add_row("normal or not", in_words(s))
    _routing_rows(table, s, "routing" in run.spec.align.regions)
    out.print(table)
    _print_graft(getattr(run, "graft_tables", {}), run.manifest.get("model", {}).get("num_layers"))


def _routing_rows(table, s: dict, replayed: bool) -> None:
    """A mixture-of-experts run: how often the stacks run a token through other experts, beside every routing noise
    floor measured (each stack's batch change, the trainer's kernel change) and the ratio to the largest, and |Δlogp|
    of the tokens right after a flipped position against the others (routing.csv: per layer). With routes replayed
    the trainer ran the engine's experts, so the count is zero by construction and the routers' own disagreement is
    in routing.csv's logit columns: the row says so rather than read as agreement."""
    from .numerics.tables import FLOOR_KINDS, ROUTING_NOISE_FLOORS, noise_floors

    if "frac_tokens_any_flip" not in s:
        return
    flips = s["frac_tokens_any_flip"]
    table.add_row("tokens run through other experts (any layer)",
                  "not recorded (manifest.json)" if flips != flips else f"{flips:.2%}")  # NaN: a side gave no ids
    if replayed:
        table.add_row("routers disagree", "routes replayed: both ran the engine's experts; where the routers' logits "
                                          "still differ is routing.csv's frac_topk_set_differs")
    for name, value in noise_floors(s, ROUTING_NOISE_FLOORS).items():
        table.add_row(f"routing noise floor: {ROUTING_NOISE_FLOORS[name]}", f"{value:.2%}")
    if "routing_largest_noise_floor" in s:
        table.add_row("routed differently / largest routing floor",
                      f"{s['frac_tokens_any_flip_over_largest_floor']:.3g}x "
                      f"({ROUTING_NOISE_FLOORS[s['routing_largest_noise_floor']]}: "
                      f"{FLOOR_KINDS[s['routing_largest_noise_floor']]})")  # by the floor's name: older folders too
    after, elsewhere = s["mean_abs_dlogp_after_flip"], s["mean_abs_dlogp_not_after_flip"]
    table.add_row("mean |Δlogp| after a flip / elsewhere",
                  "no flips" if after != after else f"{after:.3e} / {elsewhere:.3e}")  # NaN: no token after a flip


def _print_graft(tables: dict, num_layers: int | None) -> None:
    """compare --graft / --depth: the local error per op family beside the propagated one (local_families.csv),
    largest local error first, and in words which family and which step of the forward add most."""
    from .numerics.graft_reading import amplification_text, families_by_local, findings

    families = tables.get("local_families.csv")
    if families is not None:
        table = Table(title="local error per op family (local_families.csv), largest first")
        for column in ("family", "local rel_l2", "propagated rel_l2", "amplification"):
            table.add_column(column, justify="left" if column == "family" else "right")
        for row in families_by_local(families).to_dict("records"):
            table.add_row(row["family"], f"{row['local_rel_l2']:.3e}", f"{row['propagated_rel_l2']:.3e}",
                          amplification_text(row))
        out.print(table)
    for line in findings({name.removesuffix(".csv"): t for name, t in tables.items()}, num_layers):
        out.print(line, highlight=False, markup=False, soft_wrap=True)


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
    """One typer option per spec field a command of `kind` takes (spec.flat_fields): declared once, in spec/."""
    from .spec.run import COMPONENTS, RunSpec, flat_fields
    from .spec.fields import flag_of

    params = []
    for component, f, name in flat_fields(kind):
        owner = COMPONENTS[component] if component else RunSpec
        hint = typing.get_type_hints(owner)[f.name]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        cli_type, cli_default = (Optional[list[str]], None) if f.metadata.get("repeat") else _cli_type(hint, default)
        decls = [flag_of(f) if component else "--report"] + ([f.metadata["short"]] if f.metadata.get("short") else [])
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=cli_type,
                                        default=typer.Option(cli_default, *decls, help=f.metadata.get("help", ""),
                                                             rich_help_panel=_panel(kind, component, name))))
    out_opt = typer.Option(None, "--out", "-o", help=OutOpt.help, rich_help_panel=_PANELS[None])
    params.append(inspect.Parameter("out_dir", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path], default=out_opt))
    params.append(inspect.Parameter("fail_if", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[list[str]],
                                    default=typer.Option(None, "--fail-if", help=FAIL_IF_HELP,
                                                         rich_help_panel=_PANELS[None])))
    return params


def _gate(texts, kind: str):
    """The --fail-if conditions of a `kind` run, checked before anything loads (one line, exit 2, on a bad one)."""
    if not texts:
        return None
    from .reports.gate import Gate

    try:
        return Gate.parse(texts, kind)
    except ProbeError as e:
        _fail(e)


def _judged(gate, manifest: dict, rows):
    """The gate's verdict on `rows` ((where, summary) pairs), recorded in the manifest before it is written."""
    if gate is None:
        return None
    verdict = gate.judge(rows)
    manifest["gate"] = verdict.record()
    return verdict


def _exit_by(verdict) -> None:
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
        from .numerics.shapley import SHIPPED

        table = run.summary_table
        return [(f"combo {SHIPPED}", table[table["combo"] == SHIPPED].iloc[0].to_dict())]
    return [("run", run.summary)]


def _command_doc(doc: str) -> str:
    """A command's help as --help shows it: each paragraph on one line, which rich wraps at the terminal's width (a
    docstring's own line breaks would break sentences mid-line there), but the `Examples:` paragraph keeps its lines,
    one command each."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(p if p.startswith("Examples:") else " ".join(p.split()) for p in paragraphs)


def _help_from_doc(function):
    """A command function whose docstring is shaped for --help by _command_doc."""
    function.__doc__ = _command_doc(function.__doc__)
    return function


def _spec_command(kind: str, doc: str, after):
    """A typer command whose options are the spec's fields for `kind`; it builds the RunSpec, runs it, writes it."""

    def command(out_dir: Optional[Path] = None, fail_if: Optional[list[str]] = None, **flags) -> None:
        from .spec.run import spec_from_flat

        gate = _gate(fail_if, kind)
        run, out_dir, verdict = _run(lambda: spec_from_flat(kind, **flags), out_dir, gate=gate)
        after(run)
        _closing(out_dir, run.spec.report, _next_step(run))
        _exit_by(verdict)

    params = _options(kind)
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = _command_doc(doc)
    command.__name__ = kind
    return command


def _run(make_spec, out_dir: Optional[Path], check=None, gate=None, check_run=None):
    """Shared by compare, ablate and rerun: build (and so validate) the spec and check --out before anything
    loads, load once, run with a progress bar, judge the --fail-if gate, write atomically. `check(source)` runs before
    the stacks load, `check_run(manifest)` on the finished run before it is written (rerun: were these the recorded
    inputs?). Any ProbeError on the way is one line and exit code 2, and nothing is written. Returns the run, its
    folder and the gate's verdict."""
    from transformers.utils import logging as hf_logging

    import divergence_probe as dp
    from .runs.loading import load_run_prompts
    from .rundir import claim_out_dir, default_out_dir

    hf_logging.disable_progress_bar()  # transformers' per-load bars: the status line above says what is loading
    timings.start()
    try:
        spec = make_spec()
        if gate:
            gate.check_measured(spec)  # a condition this run's flags will not measure: refused before the claim
        out_dir = out_dir or default_out_dir()
        with claim_out_dir(out_dir):  # held until the run is written: a second run aiming here fails at once
            if spec.load.infer == "vllm" and spec.load.engine_args:
                from .engines.vllm.stack import check_engine_args

                check_engine_args(spec.load.engine_args, spec.load.engine)  # imports vLLM, starts no engine

            def before_stacks(source, tokenizer):  # seconds in: everything a bad input can break, before the loads
                if check is not None:
                    check(source)
                if gate:
                    gate.check_model(source.family)
                load_run_prompts(spec, tokenizer, source.max_model_len)

            with _phases() as phases:
                phases.phase("loading the model in transformers and the inference stack")
                timings.add("start", timings.process_age() or 0.0)  # the interpreter, the CLI's imports, the spec
                run = dp.run(spec, phases, before_stacks=before_stacks, spill_near=out_dir, notice=_placement_notice)
                phases.end()
            if check_run is not None:
                check_run(run.manifest)
            run.manifest["command"] = sys.argv
            run.manifest["phases"] = phases.timings
            if timings.enabled():  # the writing, the report and the exit follow: a whole-process clock has the rest
                run.manifest["timings"] = timings.record() | {"until_written": round(timings.process_age() or 0.0, 3)}
            verdict = _judged(gate, run.manifest, _summary_rows(run))
            kept = _kept_outputs(run.manifest)
            run.write(out_dir)
            if kept is not None:
                kept.rename(Path(out_dir) / KEPT_OUTPUTS)
    except ProbeError as e:
        _fail(e)
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


_COMPARE_DOC = _command_doc("""Load the same weights in vLLM and transformers, feed both the same token ids, and diff every tap of
    every decoder layer and every token's logprob.

    Writes manifest.json, prompts.jsonl, tokens.csv, layers.csv and summary.csv (columns: docs/reference/outputs.md,
    "Output files"). Without --model, the built-in model and the packaged sample prompts: it runs offline.

    Examples:
      divergence-probe compare --batch-invariance --report
      divergence-probe compare --model Qwen/Qwen2.5-1.5B --taps all
      divergence-probe compare --model M --engine compiled --engine-noise
      divergence-probe compare --model M --graft --depth
      divergence-probe compare --model M --mode generate --prompts my.jsonl
    """)
_ABLATE_DOC = _command_doc("""Rerun compare with every combination of aligned regions (RoPE, SwiGLU, residual RMSNorm) and attribute
    the vLLM-vs-transformers mismatch to regions with Shapley values and bootstrap intervals.

    Writes compare's files with a combo column, plus ablation.csv (one row per combination) and
    attribution.csv (one row per region and one for all regions together: each its change of the
    metric as a signed share of the shipped value).

    Examples:
      divergence-probe ablate --taps none
      divergence-probe ablate --model M --taps none --side train --out runs/fix
      divergence-probe ablate --model M --regions rope,swiglu,rmsnorm,lm_head
      divergence-probe ablate --model M --regions rope,rmsnorm,routing
    """)


@_lazy_command("compare", _COMPARE_DOC)
def _compare_command():
    return _spec_command("compare", _COMPARE_DOC, _print_summary)


@_lazy_command("ablate", _ABLATE_DOC)
def _ablate_command():
    return _spec_command("ablate", _ABLATE_DOC, _print_ablation)


_REMEDIES_DOC = _command_doc("""Try each candidate remedy (aligned regions, FP16, the trainer's most divergent layers in
    FP32, trainer kernels, AMP, FP8 off, MoE routing replay) against the stacks as shipped on the same prompts, and
    rank what removes a detectable part of the mismatch by effect and by what it costs each side.

    Writes remedies.csv (one row per arm, run or not and why: its change with a paired bootstrap interval, its noise
    floor, what it needs, the time and peak memory it adds to the trainer's forward, forward+backward and the engine's
    step) and compare's files with a combo column per arm.

    Examples:
      divergence-probe remedies
      divergence-probe remedies --model M --num-prompts 40 --out runs/remedies
      divergence-probe remedies --model M --arms aligned_trainer,fp32_layers,fp16 --fp32-layers 4
    """)


@_lazy_command("remedies", _REMEDIES_DOC)
def _remedies_command():
    return _spec_command("remedies", _REMEDIES_DOC, lambda run: [
        out.print(line, highlight=False, markup=False, soft_wrap=True) for line in run.lines()])


@app.command(cls=_Command)
@_help_from_doc
def rerun(
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
    from .reports.gate import METRICS
    from .runs.rerun import RecordedRun, describe, recorded_gate
    from .rundir import MANIFEST, default_out_dir, read_run

    where = f"{run_dir}/{MANIFEST}"
    target = out_dir or default_out_dir()
    if (Path(run_dir) / "rl.csv").is_file():  # an rl run folder: rl.csv and rl_summary.csv, no summary.csv
        if fail_if:
            _fail(ProbeError("--fail-if gates a compare, ablate or score run's summary; an rl run has none to gate, "
                             "so drop --fail-if"))
        _rerun_rl(run_dir, where, target, report, allow_engine_arg or ())
        return
    try:
        manifest = read_run(run_dir).manifest  # refuses a cut or changed run folder, and files outside it
        kind = manifest.get("kind")
        gate = recorded_gate(manifest, kind if kind in METRICS else "compare", fail_if, where, not no_recorded_gate)
    except ProbeError as e:
        _fail(e)
    if kind == "score":
        _rerun_score(manifest, run_dir, where, target, report, gate)
        return
    recorded = RecordedRun(manifest, Path(run_dir), where)

    def make_spec():
        spec = recorded.read_spec(report, allow_engine_arg or ())
        if gate:
            gate.check_measured(spec)  # a gate refused is the one line, before what would run is shown
        for line in describe(spec, target, gate):  # before anything loads: what this folder makes the tool run
            out.print(line, highlight=False, markup=False, soft_wrap=True)
        return spec

    run, out_dir, verdict = _run(make_spec, target, recorded.check, gate=gate, check_run=recorded.check_run)
    (_print_ablation if run.spec.kind == "ablate" else _print_summary)(run)
    _closing(out_dir, report, _next_step(run))
    _exit_by(verdict)


def _rerun_score(manifest: dict, run_dir: Path, where: str, out_dir: Path, report: bool, gate) -> None:
    """rerun of a score run folder: its recorded ScoreSpec and LoadSpec, checked, shown, then scored again and
    judged by its gate."""
    from .runs.rerun import describe_score, recorded_score, same_model

    try:
        call, load, rollouts_sha256 = recorded_score(manifest, where)
        if gate:
            gate.check_measured(call)
    except ProbeError as e:
        _fail(e)
    for line in describe_score(call, load, out_dir, gate):  # before anything loads: what this folder will run
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    run, verdict = _score_run(call, load, out_dir, lambda source: same_model(manifest, source, run_dir, "score"),
                              gate=gate, rollouts_sha256=rollouts_sha256)
    _print_score(run)
    _closing(out_dir, report, _after_score(call, load, run))
    _exit_by(verdict)


def _rerun_rl(run_dir: Path, where: str, out_dir: Path, report: bool, allowed) -> None:
    """rerun of an rl run folder: its recorded RLSpec checked and shown, then run again on the checkpoint it was made
    with."""
    from .runs.rerun import describe_rl, recorded_rl_run, same_model

    try:
        manifest, spec = recorded_rl_run(Path(run_dir), where, allowed)
    except ProbeError as e:
        _fail(e)
    for line in describe_rl(spec, out_dir):  # before anything loads: what this folder makes the tool run
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    _rl_run(spec, out_dir, report, lambda source: same_model(manifest, source, run_dir, "rl"))


def _print_ablation(run) -> None:
    from .numerics.noise_verdict import floor_moved
    from .numerics.shapley import CHANGE, SHARE, SHIPPED, attribution_lines, effect_words
    from .numerics.tables import NOT_CAPTURED

    metric = run.spec.ablate.metric
    combos = run.ablation_table.sort_values(metric, kind="stable")
    table = Table(title=f"ablation ({run.spec.align.side}), sorted by {metric}")
    taps = (combos["first_inexact"] != NOT_CAPTURED).any()  # --taps none: no first-divergence column
    for col in ("combo", metric, "mean_abs_dlogp", *(["first_inexact"] if taps else [])):
        table.add_column(col, justify="left" if col in ("combo", "first_inexact") else "right")
    for row in combos.itertuples():
        table.add_row(row.combo, f"{getattr(row, metric):.3e}", f"{row.mean_abs_dlogp:.3e}",
                      *([row.first_inexact] if taps else []))
    out.print(table)
    shipped = run.metric_of()[frozenset()]
    attr = Table(title=f"change in {metric} when aligned, as a share of the shipped {shipped:.3e} "
                       "(− removes mismatch, + adds)")
    pct = f"{run.spec.ablate.ci_level:.0%}"
    level = f"{pct} CI"
    factors = bool(run.spec.ablate.factors)
    for col in ("region" + (" or factor" if factors else ""), "shapley change", "share of shipped", level,
                "main effect", "leave-one-out"):
        attr.add_column(col, justify="left" if col.startswith("region") else "right")
    def signed(x: float, spec: str = "+.3e") -> str:
        return "" if x != x else format(x, spec)

    rows = run.attribution_table.to_dict("records")
    for row in rows:
        low, high = row["share_ci_low"], row["share_ci_high"]
        attr.add_row(row["region"], signed(row[CHANGE]), effect_words(row[SHARE], low, high, pct),
                     f"[{signed(low, '+.1%')}, {signed(high, '+.1%')}]" if low == low and high == high else "none",
                     signed(row["main_effect_change"]), signed(row["leave_one_out_change"]))
    out.print(attr)
    summaries = run.ablation_table.set_index("combo")
    everything = summaries.index[-1]  # subsets() order: every region aligned comes last
    moved = floor_moved(summaries.loc[SHIPPED].to_dict(), summaries.loc[everything].to_dict(), everything)
    for line in attribution_lines(rows, metric, factors, pct) + ([moved] if moved else []):
        out.print(line, highlight=False, markup=False, soft_wrap=True)


@app.command(cls=_Command, name="report")
@_help_from_doc
def report_command(
    run_dir: Path = typer.Argument(..., help="A run folder (the --out of compare, ablate, score or rl)."),
    fmt: str = typer.Option("md", "--format", "-f", help="md (report.md + PNG/PDF figures), html (one self-contained report.html) or latex (report.tex, booktabs tables, PDF figures)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="New or empty folder, or one holding a previous report (replaced). Default: RUN_DIR/report."),
) -> None:
    """Render a run folder as a report a reader understands without the tool: setup, headline numbers,
    first divergence, tables and figures (error growth across layers, Δlogprob, KL by position, attribution).

    Examples:
      divergence-probe report runs/normal
      divergence-probe report runs/normal --format html --out reports/normal
    """
    _write_report(run_dir, out_dir, fmt)


def _write_report(run_dir: Path, out_dir: Optional[Path] = None, fmt: str = "md") -> None:
    from .reports.render import write_report

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


@app.command(cls=_Command, name="diff")
@_help_from_doc
def diff_command(
    run_a: Path = typer.Argument(..., help="The first run folder (before: e.g. the old engine or trainer)."),
    run_b: Path = typer.Argument(..., help="The second run folder, of the same prompts and model (after)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="New or empty folder for the diff's files. "
                                           "Default: runs/<date>-<time>-<microseconds>."),
) -> None:
    """Show what moved between two runs of the same prompts and model: summary metrics with both runs' noise floors,
    layers whose error grew, tokens whose |Δlogp| moved most, routing per layer, and the settings that differ.

    Writes diff_summary.csv, diff_layers.csv, diff_tokens.csv, diff_manifest.csv (and diff_routing.csv for a
    mixture of experts) and diff.md. Runs of other prompts or another model are refused.

    Examples:
      divergence-probe diff runs/before runs/after
      divergence-probe diff runs/shipped runs/rope-aligned --out runs/what-rope-moved
    """
    from .reports.diff import TOP, diff_runs
    from .rundir import default_out_dir

    try:
        diff = diff_runs(run_a, run_b)
        out_dir = diff.write(out_dir or default_out_dir())
    except ProbeError as e:
        _fail(e)
    table = Table(title="A → B (diff_summary.csv)")
    for col in ("metric", "A", "B", "B / A"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for row in diff.summary.itertuples():
        shown = [f"{v:.3e}" if isinstance(v, float) else str(v) for v in (row.a, row.b)]
        table.add_row(row.metric + (" (noise floor)" if row.noise_floor else ""), *shown,
                      "" if row.ratio != row.ratio else f"{row.ratio:.3g}")
    out.print(table)
    grew = diff.layers[diff.layers["grew"]]
    out.print(f"layers whose error grew: {len(grew)} of {len(diff.layers)}; tokens lined up: {len(diff.tokens)}; "
              f"settings that differ: {len(diff.manifest)}", highlight=False)
    for row in diff.manifest.head(TOP).itertuples():
        out.print(f"  {row.key}: {row.a} -> {row.b}", highlight=False, markup=False, soft_wrap=True)
    out.print(f"diff: {out_dir}", highlight=False, markup=False, soft_wrap=True)


def _rl_options() -> list[inspect.Parameter]:
    """One typer option per RLSpec field (declared once, in spec/rl.py); a tuple field is a repeatable flag."""
    from .spec.rl import RLSpec
    from .spec.fields import flag_of

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
    from . import rl
    from .rundir import default_out_dir

    try:
        spec = rl.RLSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in flags.items() if v is not None
                            or k in ("model", "prompts", "reward")})
    except ProbeError as e:
        _fail(e)
    _rl_run(spec, out_dir or default_out_dir(), report)


def _rl_run(spec, out_dir: Path, report: bool, check=None) -> None:
    """Shared by rl and rerun: run the experiment with one bar per (setting, seed) run, print its summary and the
    closing lines; a ProbeError is one line (rl/experiment.py leaves no folder, or saves the rows it made)."""
    from transformers.utils import logging as hf_logging

    from . import rl
    from .runs.next_steps import after_rl

    hf_logging.disable_progress_bar()
    try:
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
                if done == total:  # the last run's phase ends with its last step, before the manifest is written
                    phases.end()

            result = rl.run(spec, out_dir, progress, check=check,
                            recorded=lambda: {"phases": phases.timings})
            phases.end()
    except ProbeError as e:
        _fail(e)
    _print_rl_summary(result.summary)
    _closing(out_dir, report, after_rl(spec, _family(result.manifest), result.summary))


def _print_rl_summary(summary) -> None:
    """rl_summary.csv as a table: each run's mean reward and mismatch over its first steps and over its last ones,
    the steps named (numerics/rl_summary.py window: the two never overlap)."""
    import pandas as pd

    from .numerics.collapse import GROWTH
    from .numerics.rl_summary import comparison_words, window_label

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
        out.print(line, highlight=False, markup=False, soft_wrap=True)


_RL_DOC = _command_doc("""A small GRPO loop: vLLM samples, a verifiable reward scores, transformers updates, and the
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
rl_command.__doc__ = _RL_DOC


@_lazy_command("rl", _RL_DOC)
def _rl_command():
    rl_command.__signature__ = inspect.Signature(_rl_options())  # RLSpec's fields: imports rl/ (torch)
    return rl_command


@app.command(cls=_Command, name="score")
@_help_from_doc
def score_command(
    rollouts: list[Path] = typer.Argument(..., help="Rollout file your RL run recorded: .jsonl, .jsonl.gz or "
                                          ".parquet. Several files, a folder or a glob: one file per RL step, scored "
                                          "step by step into steps.csv (the run's history)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="The checkpoint the rollouts were sampled from "
                                        "(folder or hub id). Default: the built-in tiny trained Qwen3."),
    fmt: str = typer.Option("auto", "--format", help="auto (from the field names), verl, openrlhf, slime, trl or "
                            "generic."),
    fields: Optional[str] = typer.Option(None, "--fields", help="Generic format's columns: prompt_ids=COL,"
                                         "response_ids=COL,logprobs=COL[,group=COL]; in any format, the two logprob "
                                         "columns: infer=COL,train=COL (with the trainer's, no model is needed)."),
    infer: Optional[str] = typer.Option(None, "--infer", help="vllm: also re-score every sequence with the engine's "
                                        "prefill (logprob_prefill; the three-way split)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="The run's sampling temperature: every "
                                                "logprob compared (trainer, prefill, KL) is taken at it, as in a "
                                                "tempered recording; the raw gap stays beside it."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="The trainer's dtype: bfloat16, float16 or float32."),
    device: str = typer.Option("auto", "--device", help="auto (cuda when present), cpu or cuda."),
    train_attn: str = typer.Option("sdpa", "--train-attn", help="transformers attention: sdpa, eager or "
                                   "flash_attention_2."),
    train_sdpa: str = typer.Option("auto", "--train-sdpa", help="SDPA kernel: auto, math, flash, efficient or cudnn."),
    train_kernels: str = typer.Option("torch", "--train-kernels", help="The trainer's kernel set: torch "
                                      "(transformers' ops), vllm (the engine's RMSNorm, add+norm, SiLU-and-mul and "
                                      "rotary kernels) or liger (Liger-Kernel's; CUDA only)."),
    clip_eps: float = typer.Option(0.2, "--clip-eps", help="PPO clip band [1-eps, 1+eps] for the ratio metrics."),
    tis_cap: float = typer.Option(2.0, "--tis-cap", help="TIS truncation cap C (token MIS band [1/C, C])."),
    alarm: Optional[list[str]] = typer.Option(None, "--alarm", help="Several steps: mark the first step where METRIC "
                                              ">VALUE (a steps.csv column); repeatable. Default: k3>1e-3 and "
                                              "frac_abs_dlogp_over_ln2>1e-3."),
    fail_if: Optional[list[str]] = typer.Option(None, "--fail-if", help=FAIL_IF_HELP + " Several steps: fails when "
                                                "it holds at any step."),
    allow_untested_versions: bool = typer.Option(False, "--allow-untested-versions",
                                                 help=ALLOW_HELP),
    out_dir: Optional[Path] = OutOpt,
) -> None:
    """Score the rollouts your RL run recorded with the training stack, as generate mode's trainer side does.

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
    """
    from .runs.history import parse_alarms, step_files
    from .rundir import default_out_dir
    from .spec.score import ScoreSpec
    from .spec.load import LoadSpec

    try:
        files = step_files(rollouts)
        many = len(files) > 1 or any(Path(p).is_dir() for p in rollouts)
        gate = _gate(fail_if, "history" if many else "score")
        alarms = parse_alarms(alarm) if many else None
        if alarm and not many:
            raise ProbeError("--alarm marks steps of a run's history; pass several rollout files (a folder or a "
                             "glob), or drop --alarm")
        call = ScoreSpec(rollouts=str(files[0].absolute()), fmt=fmt, fields=fields, infer=infer,
                         temperature=temperature, clip_eps=clip_eps, tis_cap=tis_cap)
        load = LoadSpec(model=model, dtype=dtype, device=device, train_attn=train_attn, train_sdpa=train_sdpa,
                        train_kernels=train_kernels, allow_untested_versions=allow_untested_versions)
        for conditions in (gate, alarms):
            if conditions:
                conditions.check_measured(call)
    except ProbeError as e:
        _fail(e)
    out_dir = out_dir or default_out_dir()
    if many:
        _score_history(files, call, load, out_dir, alarms, gate)
        return
    run, verdict = _score_run(call, load, out_dir, gate=gate)
    _print_score(run)
    _closing(out_dir, False, _after_score(call, load, run))
    _exit_by(verdict)


def _after_score(call, load, run):
    """score's next command; none after a model-free one (splitting its gap needs the checkpoint, which only the
    user can name)."""
    from .runs.next_steps import after_score
    from .runs.paired import RECORDED_TRAINER

    if run.manifest["score"].get("trainer") == RECORDED_TRAINER:
        return None
    return after_score(call, load, run.summary)


def _score_history(files, call, load, out_dir: Path, alarms, gate) -> None:
    """score over many steps (runs/history.py): steps.csv, alarms.csv, steps.png; the alarms that fired; the gate."""
    from transformers.utils import logging as hf_logging

    from .runs.score import score_steps
    from .reports.steps import draw_steps
    from .rundir import claim_out_dir

    hf_logging.disable_progress_bar()
    try:
        with claim_out_dir(out_dir), _phases() as phases:
            phases.phase(f"reading {len(files)} steps" + ("" if load.model is None else ", loading the trainer"))
            history = score_steps(files, out_dir, call, load, alarms=alarms, gate=gate, draw=draw_steps,
                                  progress=phases)
            phases.end()
    except ProbeError as e:
        _fail(e)
    table = Table(title=f"{history.n_steps} steps (steps.csv); alarms (alarms.csv)")
    for col in ("alarm", "first step past it", "value"):
        table.add_column(col, justify="left" if col == "alarm" else "right")
    for a in history.alarms:
        table.add_row(a.condition.text, "never" if a.first_step is None else str(a.first_step),
                      "" if a.value is None else f"{a.value:.3e}")
    out.print(table)
    out.print(f"run: {out_dir}", highlight=False, markup=False, soft_wrap=True)
    _exit_by(history.verdict)


def _score_run(call, load, out_dir: Path, check=None, gate=None, rollouts_sha256: str | None = None):
    """Shared by score and rerun: claim --out, score, judge the gate, write; a ProbeError is one line and nothing
    is written."""
    from transformers.utils import logging as hf_logging

    from .rundir import claim_out_dir
    from .runs.score import score_spec

    hf_logging.disable_progress_bar()
    try:
        with claim_out_dir(out_dir), _phases() as phases:
            phases.phase("reading the rollouts, loading the trainer" + (" and the engine" if call.infer else ""))
            run = score_spec(call, load, check, phases, rollouts_sha256, gate)
            phases.end()
            run.manifest["command"] = sys.argv
            run.manifest["phases"] = phases.timings
            verdict = _judged(gate, run.manifest, [("run", run.summary)])
            run.write(out_dir)
    except ProbeError as e:
        _fail(e)
    except MemoryError:  # below the rollout bounds, under a tighter limit than they were set for (or a model's size)
        _fail(ProbeError(f"out of memory scoring {call.rollouts}: this process may not take the memory the scoring "
                         "needs (docs/reference/errors.md: what each rollout bound costs); raise its memory limit or split "
                         "the file (one RL step per file)"))
    return run, verdict


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


@app.command(cls=_Command, name="make-model")
@_help_from_doc
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

    Examples:
      divergence-probe make-model models/tiny
      divergence-probe make-model models/moe --arch qwen3_moe
      divergence-probe make-model models/q7 --preset qwen2.5-7b --layers 4
      divergence-probe compare --model models/q7 --device cuda
    """
    from .models.modelzoo import make_model as build

    try:
        with console.status(f"building {preset} ({arch})…" if arch else f"building {preset}…"):
            path = build(out_dir, arch=arch, preset=preset, seed=seed, overwrite=overwrite, num_layers=layers)
    except ProbeError as e:
        _fail(e)
    out.print(f"model: {path}")


def _usage_line(error: click.UsageError) -> str:
    """A mistyped command line as one line: an unknown option names the command's nearest one (difflib), every other
    usage error keeps click's words; both say where the valid options are listed."""
    ctx = error.ctx
    where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    if isinstance(error, click.NoSuchOption) and ctx is not None:
        names = [o for p in ctx.command.get_params(ctx) for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
        nearest = difflib.get_close_matches(error.option_name, names, n=1, cutoff=0)
        if nearest:
            return f"{ctx.info_name} has no option {error.option_name}; the nearest is {nearest[0]}{where}"
    return one_line(error.format_message()) + where


def _plain_streams() -> None:
    """A stdout that cannot encode a character (PYTHONIOENCODING=ascii, LANG=C with a pipe) shows it as `?`: the
    results were written already, and an encoding error there would turn a run's exit code into 1, the code of a
    gate that failed. A COLUMNS that is no width (0, empty, a word) is dropped, so typer's help ignores it as the
    tool's consoles do (columns_for)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):  # not a text stream, or a closed one
            stream.reconfigure(errors="replace" if stream is sys.stdout else "backslashreplace")
    columns = os.environ.get("COLUMNS")
    if columns is not None and not (columns.strip().isdigit() and int(columns) > 0):
        del os.environ["COLUMNS"]


def main() -> None:
    """The console entry point: SIGTERM stops a command like Ctrl-C (its cleanups run), then one line and 128+N;
    the libraries' own output is silenced unless -v (`_libraries_silenced`)."""
    from .signals import stop_behind, stop_on_signals

    _plain_streams()
    quiet = contextlib.nullcontext() if _wants_verbose(sys.argv[1:]) else _libraries_silenced()
    try:
        with stop_on_signals(), quiet:
            try:  # not standalone: click's own usage message would go to the silenced stderr, and be a panel
                code = app(standalone_mode=False)
            except click.NoArgsIsHelpError as e:
                e.show()  # the help, on stdout
                code = e.exit_code
            except click.UsageError as e:
                console.print(f"[bold red]error:[/] {escape(_usage_line(e))}", highlight=False)
                code = e.exit_code
            except click.ClickException as e:
                console.print(f"[bold red]error:[/] {escape(one_line(e.format_message()))}", highlight=False)
                code = e.exit_code
            except typer.Abort:
                console.print("[bold red]stopped:[/] aborted", highlight=False)
                code = 1
        raise SystemExit(code if isinstance(code, int) else 0)
    except BaseException as e:
        stop = stop_behind(e)
        if stop is None:
            raise
        console.print(f"[bold red]stopped:[/] {stop.name} received; nothing was left half-written", highlight=False)
        raise SystemExit(stop.code) from None
