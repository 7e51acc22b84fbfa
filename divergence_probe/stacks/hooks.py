"""Forward hooks that are always removed: a capture never outlives the run that asked for it."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch


class HookSet(AbstractContextManager):
    """Collects hook handles (and undo callbacks) and removes them all on exit, even on error."""

    def __init__(self) -> None:
        self._undo: list = []

    def after(self, module: torch.nn.Module, fn) -> None:
        """fn(module, args, kwargs, output) after module's forward."""
        self._undo.append(module.register_forward_hook(fn, with_kwargs=True).remove)

    def before(self, module: torch.nn.Module, fn) -> None:
        """fn(module, args, kwargs) before module's forward; returns None so inputs are untouched."""
        self._undo.append(module.register_forward_pre_hook(fn, with_kwargs=True).remove)

    def on_exit(self, undo) -> None:
        self._undo.append(undo)

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()


def first_tensor(output) -> torch.Tensor:
    """vLLM layers return (tensor, extra) tuples, transformers' mostly tensors; taps want the tensor."""
    return output[0] if isinstance(output, (tuple, list)) else output


def arg(args: tuple, kwargs: dict, index: int, name: str) -> torch.Tensor:
    """A forward argument, whether it was passed by position or by keyword."""
    return args[index] if len(args) > index else kwargs[name]
