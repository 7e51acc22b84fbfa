"""The `divergence-probe` group: its commands in their order, the ones whose options come from a spec built on first
use, the app's own -v, and `main`, the console entry point (usage errors and signals as one line and an exit code).

Nothing torch-bound is imported here: the spec (spec/ and what it imports) is read only when a command that takes
its options from it is run or asked for its own --help (LazyGroup), and every other import of the library is inside
the function that needs it. So `divergence-probe --help` and the --help of rerun, report, diff and make-model need
no torch from this package (the package's __init__, which runs first, is another matter).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys

import typer
from typer._click import exceptions as click  # typer's own copy of click: its usage errors

from ..errors import one_line
from ..quiet import quiet_libraries, show_libraries
from . import compare, diff, make_model, report, rerun, rl, score
from .console import console, error_line, libraries_silenced, plain_streams
from .options import Command, untyped_flags

ORDER = ("compare", "ablate", "remedies", "rerun", "report", "diff", "rl", "score", "make-model")
# The commands whose options are a spec's fields: name -> (docstring, function making the command's callback). They
# are listed (name and summary) from a placeholder and built when resolved to run or to show their own --help.
LAZY = {"compare": (compare.COMPARE_DOC, compare.compare_command),
        "ablate": (compare.ABLATE_DOC, compare.ablate_command),
        "remedies": (compare.REMEDIES_DOC, compare.remedies_command),
        "rl": (rl.RL_DOC, rl.make_rl_command),
        "score": (score.SCORE_DOC, score.make_score_command)}


class LazyGroup(typer.core.TyperGroup):
    """The app's click group: LAZY's commands are placeholders until resolved; command order is ORDER's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._listing = False
        built = dict(self.commands)
        self.commands = {}
        for name in ORDER:
            if name in LAZY:
                self.commands[name] = _placeholder(name, LAZY[name][0])
            elif name in built:
                self.commands[name] = built.pop(name)
        self.commands.update(built)  # any command not in ORDER, after the rest

    def get_command(self, ctx, cmd_name: str):
        command = self.commands.get(cmd_name)
        if getattr(command, "_placeholder", False) and not self._listing:
            command = self.commands[cmd_name] = _build_command(cmd_name, LAZY[cmd_name][1]())
        return command

    def get_params(self, ctx):
        return untyped_flags(super().get_params(ctx))

    def format_help(self, ctx, formatter) -> None:
        self._listing = True  # the list of commands reads the placeholders; nothing is built for it
        try:
            return super().format_help(ctx, formatter)
        finally:
            self._listing = False


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
    single.command(name, cls=Command)(callback)
    return typer.main.get_command(single)


app = typer.Typer(
    cls=LazyGroup,
    add_completion=False,
    no_args_is_help=True,
    help="Find where vLLM and the transformers training stack round differently, layer by layer and token by token.",
)
for _name, _callback in (("rerun", rerun.rerun_command), ("report", report.report_command),
                         ("diff", diff.diff_command), ("make-model", make_model.make_model)):
    app.command(cls=Command, name=_name)(_callback)

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


def main() -> None:
    """The console entry point: SIGTERM stops a command like Ctrl-C (its cleanups run), then one line and 128+N;
    the libraries' own output is silenced unless -v (`console.libraries_silenced`)."""
    from ..signals import stop_behind, stop_on_signals

    plain_streams()
    quiet = contextlib.nullcontext() if _wants_verbose(sys.argv[1:]) else libraries_silenced()
    try:
        with stop_on_signals(), quiet:
            try:  # not standalone: click's own usage message would go to the silenced stderr, and be a panel
                code = app(standalone_mode=False)
            except click.NoArgsIsHelpError as e:
                e.show()  # the help, on stdout
                code = e.exit_code
            except click.UsageError as e:
                error_line(_usage_line(e))
                code = e.exit_code
            except click.ClickException as e:
                error_line(one_line(e.format_message()))
                code = e.exit_code
            except typer.Abort:
                console.print("[bold red]stopped:[/] aborted", highlight=False, markup=True)
                code = 1
        raise SystemExit(code if isinstance(code, int) else 0)
    except BaseException as e:
        stop = stop_behind(e)
        if stop is None:
            raise
        console.print(f"[bold red]stopped:[/] {stop.name} received; nothing was left half-written", highlight=False,
                      markup=True)
        raise SystemExit(stop.code) from None
