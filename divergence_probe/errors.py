"""Errors a user can fix. Each message names the problem and the fix; the CLI prints it as one line.

Anything that is not a ProbeError is a bug in divergence-probe and keeps its traceback.
"""

import re
from pathlib import Path

# The documentation the package carries (package data: divergence_probe/docs is docs/ of the repository), so that an
# installed wheel has the pages its messages point at.
DOCS = Path(__file__).resolve().parent / "docs"
_DOC_POINTER = re.compile(r"(?<![\w/.])docs/([\w./-]+\.md)")


def printable(text: object) -> str:
    """text with every character a terminal would act on (ESC, a newline, a carriage return, other control and
    format characters) written as its Python escape, e.g. \\x1b: a string from a run folder or a file is data, and
    shown as such it can neither clear the screen nor forge a line of its own."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def one_line(text: object, limit: int | None = None) -> str:
    """A message that quotes a library's text (or a file's) can hold newlines and escape sequences; a log line must
    hold neither."""
    flat = printable(" ".join(str(text).split()))
    return flat[:limit] if limit else flat


def docs_at_hand(message: str) -> str:
    """`message` with each pointer to a page of the documentation (written as its repository path, "docs/reference/install.md,
    'Supported versions'") naming a copy the user has: the path as written where it leads from the current folder (a
    checkout's root), else the copy installed with the package, by its full path."""
    def at_hand(pointer: re.Match) -> str:
        shipped = DOCS / pointer.group(1)
        if Path(pointer.group(0)).is_file() or not shipped.is_file():
            return pointer.group(0)
        return str(shipped.resolve())
    return _DOC_POINTER.sub(at_hand, message)


class ProbeError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""

    exit_code = 2


class ModelError(ProbeError):
    """The model path, hub id, architecture or weights cannot be used."""


class PromptError(ProbeError):
    """The prompts are missing, empty, malformed or too long."""


class OutputError(ProbeError):
    """The output directory cannot be written."""


class StackError(ProbeError):
    """An inference or training stack is missing, or behaves in a way the tool does not understand."""


class NumericsError(ProbeError):
    """NaN or Inf where a finite number is required (weights, logits)."""


class DeviceMemoryError(ProbeError):
    """The run does not fit in the device's free memory (found before loading), or ran out of it."""


class SyncError(ProbeError):
    """The engine does not compute with the trainer's weights after a push."""


class StaleCacheError(SyncError):
    """After a push, the prefix cache served KV computed with the previous weights."""
