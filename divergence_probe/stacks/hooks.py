"""Hooks and attribute patches that are always undone: a capture or a region patch never outlives its run."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch


class HookSet(AbstractContextManager):
    """Collects hook handles and attribute patches and undoes them all, in reverse order, on exit (even on error)."""

    def __init__(self) -> None:
        self._undo: list = []
        self._replaced: set[tuple[int, str]] = set()

    def after(self, module: torch.nn.Module, fn) -> None:
        """fn(module, args, kwargs, output) after module's forward."""
        self._undo.append(module.register_forward_hook(fn, with_kwargs=True).remove)

    def before(self, module: torch.nn.Module, fn) -> None:
        """fn(module, args, kwargs) before module's forward; returns None so inputs are untouched."""
        self._undo.append(module.register_forward_pre_hook(fn, with_kwargs=True).remove)

    def on_exit(self, undo) -> None:
        self._undo.append(undo)

    def replace(self, obj, name: str, value) -> None:
        """Set obj.name = value until exit. Patching one attribute twice is a conflict between patches: raise."""
        key = (id(obj), name)
        if key in self._replaced:
            raise RuntimeError(f"{type(obj).__name__}.{name} is patched twice; two region patches overlap")
        self._replaced.add(key)
        had_own = name in vars(obj)
        previous = vars(obj).get(name)
        setattr(obj, name, value)

        def restore() -> None:
            if had_own:
                setattr(obj, name, previous)
            else:
                delattr(obj, name)  # back to the class attribute (e.g. the class's forward)
            self._replaced.discard(key)

        self._undo.append(restore)

    def remove(self) -> None:
        """Undo everything now (for callers that do not use `with`)."""
        self.__exit__(None, None, None)

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()


def first_tensor(output) -> torch.Tensor:
    """vLLM layers return (tensor, extra) tuples, transformers' mostly tensors; taps want the tensor."""
    return output[0] if isinstance(output, (tuple, list)) else output


def arg(args: tuple, kwargs: dict, index: int, name: str) -> torch.Tensor:
    """A forward argument, whether it was passed by position or by keyword."""
    return args[index] if len(args) > index else kwargs[name]
