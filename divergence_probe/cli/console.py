"""What the command line shows: the two consoles (results on stdout, the tool's own lines on stderr), their width,
the progress bars and phase lines of a long run, error lines and the silenced libraries.

Errors a user can fix (ProbeError) become one red line and exit code 2 (`fail`); anything else is a bug and keeps
its traceback. Set DP_RAISE_ERRORS=1 to get tracebacks for ProbeErrors too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Column

from ..errors import ProbeError, docs_at_hand, one_line

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


# soft_wrap: an error stays one line in a pipe or CI log (no wrap). No emoji codes and no markup unless a print asks
# for it: paths, names and messages are the user's text (`/tmp/o:smile:` or `[bold]x` is a path to copy as typed);
# the tool's own styles (`error:` in red) are markup=True prints that escape what they interpolate.
console = _Console(stderr=True, soft_wrap=True, emoji=False, markup=False)
out = _Console(emoji=False, markup=False)


def say(text: str) -> None:
    """One line of results on stdout, as written: no markup, no highlighting, never wrapped (a path to copy)."""
    out.print(text, highlight=False, markup=False, soft_wrap=True)


def error_line(text: str) -> None:
    """`error: TEXT` on stderr, one line."""
    console.print(f"[bold red]error:[/] {escape(text)}", highlight=False, markup=True)


def fail(error: ProbeError) -> None:
    """The one boundary of a user's error: one line and its exit code (DP_RAISE_ERRORS: the traceback instead)."""
    if os.environ.get("DP_RAISE_ERRORS"):
        raise error
    console.print(f"[bold red]error:[/] {escape(docs_at_hand(one_line(error)))}", highlight=False, markup=True)
    raise typer.Exit(error.exit_code)


@contextlib.contextmanager
def libraries_silenced():
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


def plain_streams() -> None:
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


def _progress() -> Progress:
    # transient: the bars are for a person watching; they leave no lines in a log, where an error stays one line (off
    # outside a terminal, where rich would still end them with an empty line, and Phases writes lines instead).
    # The description takes the width the rest leaves (cut with an ellipsis): on a narrow terminal the counts and the
    # times stay whole. A description is shown as written (markup=False): it can hold an rl setting's name.
    return Progress(TextColumn("{task.description}", markup=False,
                               table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
                    BarColumn(bar_width=12), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"),
                    TimeRemainingColumn(compact=True), console=console, transient=True, expand=True,
                    disable=not console.is_terminal)


class Phases:
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
def phases():
    with _progress() as bar:
        shown = Phases(bar)
        try:
            yield shown
        finally:  # an error's line comes after the block: no phase line may follow it
            shown.stop_timer()
