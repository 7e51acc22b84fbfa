"""SIGTERM and SIGINT as one exception path, so a command cleans up the same whichever signal stops it.

Python turns SIGINT into KeyboardInterrupt, which unwinds the stack through every `finally` and
`except BaseException` cleanup (hidden temporary folders, the vLLM engine's rendezvous file); SIGTERM, what
schedulers and `timeout` send, kills the process where it stands and leaves all of that behind. While a command
runs, both raise `Stopped` instead: a SystemExit, so cleanups run, `except Exception` handlers that turn failures
into messages let it through, and the process exits with the shell's code for the signal (128 + number). Child
processes registered with `pass_on_to` (vLLM engine workers) get SIGTERM at the same moment, so they stop together
with the command instead of one by one as its cleanups reach them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(SystemExit):
    """A signal stopped the command; `code` is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


def stop_behind(error: BaseException) -> Stopped | None:
    """The Stopped that `error` is, or was raised from. A signal that lands in code which turns every exception into
    its own still stops the command: CPython reports a C extension module whose initialisation a Stopped cut short
    as "ImportError: initialization failed", raised from the Stopped. Only causes are followed, not the exceptions
    being handled: a cleanup that fails while a stop unwinds is a failure of its own, not a clean stop."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Stopped):
            return error
        seen.add(id(error))
        error = error.__cause__
    return None


_pending: list[int] = []  # a signal that arrived where raising would lose it, to raise again shortly
_children: dict[int, object] = {}  # pid -> subprocess.Popen: processes the stop is passed on to


def pass_on_to(proc) -> None:
    """Pass a stop on to the child process `proc` (a subprocess.Popen) as SIGTERM the moment it arrives, until
    `forget(proc)`: a child busy on its own (a vLLM engine building) reads no request to stop, and stopping each
    only when the unwinding reaches its close would add their stop times up, one after the other."""
    _children[proc.pid] = proc


def forget(proc) -> None:
    _children.pop(proc.pid, None)


def _lost_if_raised(frame) -> bool:
    """Whether an exception raised in `frame` would be swallowed: inside a __del__ or a weakref callback (run by the
    garbage collector at any bytecode), Python prints "Exception ignored" and carries on as if nothing happened."""
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code.co_filename.endswith("weakref.py"):
            return True
        frame = frame.f_back
    return False


def _stop(signum: int, frame) -> None:
    if _lost_if_raised(frame):
        _pending[:] = [signum]
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # SIGALRM -> _retry, once the finalizer has returned
        return
    # The first signal starts the cleanup; a second SIGTERM (schedulers repeat it) must not cut that cleanup short,
    # while a second Ctrl-C still aborts at once, as a user pressing it twice expects.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for pid, proc in list(_children.items()):
        if proc.returncode is None:  # not reaped yet: the pid is still this child's, so the signal cannot go astray
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
    raise Stopped(signum)


def _retry(_signum: int, frame) -> None:
    if _pending:
        _stop(_pending[0], frame)


@contextlib.contextmanager
def stop_on_signals():
    """Within the block, SIGINT and SIGTERM raise Stopped in the main thread; the previous handlers come back
    after. Outside the main thread (where Python cannot install handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _stop) for s in SIGNALS}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, _retry)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _pending.clear()
        for s, handler in previous.items():
            signal.signal(s, handler)
