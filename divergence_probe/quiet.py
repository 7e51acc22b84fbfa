"""The libraries' own output (vLLM's and transformers' logs, the hub's progress bars, torch's C++ log), quieted so
that what a run prints is the tool's: the CLI for its whole process (unless -v), the API for each load and run
(unless quiet=False).

The levels are set where each library reads them: environment variables, read when a library is first imported
and inherited by the processes it starts (vLLM's engine core, the engine workers), which a logger level set in this
process would not reach; and the loggers of a library imported already. Only where the user has not set them."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

ENVIRONMENT = (("VLLM_LOGGING_LEVEL", "ERROR"), ("TRANSFORMERS_VERBOSITY", "error"),
               ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TORCH_CPP_LOG_LEVEL", "ERROR"))
LOGGERS = ("vllm", "transformers")  # each library's root logger
_shown = False  # the CLI's -v: the libraries' output asked for, for the whole process


def show_libraries() -> None:
    """For the rest of the process (the CLI's -v): the API's quieting stands aside."""
    global _shown
    _shown = True


def quiet_libraries() -> None:
    """For the rest of the process (the CLI)."""
    for name, value in ENVIRONMENT:
        os.environ.setdefault(name, value)
    if "transformers" in sys.modules:  # imported already (the API before the CLI): its level is read at import
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()


@contextlib.contextmanager
def libraries_quieted(quiet: bool = True):
    """For the block (the API's load and run), then as it was: the caller's own logging set-up is left alone after
    it, and the engine processes started in the block keep the quiet levels they inherited."""
    if not quiet or _shown:
        yield
        return
    added = [(name, value) for name, value in ENVIRONMENT if name not in os.environ]
    levels = {name: logging.getLogger(name).level for name in LOGGERS}
    os.environ.update(added)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.level, logging.ERROR))
    try:
        yield
    finally:
        for name, _ in added:
            os.environ.pop(name, None)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
