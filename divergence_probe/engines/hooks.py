"""Hooks and replacements that are always undone: a capture or a region patch never outlives its run."""

from __future__ import annotations

import types
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Iterable

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing the module (the CLI's --help) needs no torch
    import torch

from ..errors import StackError


class PatchConflict(StackError):
    """Two live patches replace the same attribute or registry entry: the second would silently undo or wrap
    the first (and the first's restore would then clobber the second), so neither may proceed."""


@dataclass(frozen=True)
class Replacement:
    """One planned change: `target.name = value`, or `target[name] = value` for a dict entry (`item`).

    `owner` names who asks (a region, a capture) for conflict messages. `shared` marks a replacement that
    several models of one class plan identically (a modeling module's function): planned twice in one
    `HookSet.apply`, it is applied once instead of being a conflict. `pooled` goes further: planned by another
    live HookSet with the same value (two trainers on one kernel set), it is held by both and put back when the
    last lets go."""

    target: object
    name: str
    value: object
    item: bool = False
    owner: str = ""
    shared: bool = False
    pooled: bool = False
    label: str = ""  # how to name the target in messages, when its type's name says too little

    @property
    def key(self) -> tuple:
        return ("item" if self.item else "attr", id(self.target), self.name)

    def describe(self) -> str:
        if self.item:
            return f"{self.label or type(self.target).__name__}[{self.name!r}]"
        if isinstance(self.target, types.ModuleType):
            return f"{self.target.__name__}.{self.name}"
        return f"{self.label or type(self.target).__name__}.{self.name}"


# Every replacement live in this process, whichever HookSet made it: the capture and the region patches use
# separate HookSets, and a conflict between them must be as visible as one within a set.
_LIVE: dict[tuple, Replacement] = {}
_HOLDERS: dict[tuple, int] = {}  # how many HookSets hold each live replacement (more than one only when shared)


class HookSet(AbstractContextManager):
    """Collects hook handles and replacements and undoes them all, in reverse order, on exit (even on error)."""

    def __init__(self) -> None:
        self._undo: list = []

    def after(self, module: torch.nn.Module, fn) -> None:
        """fn(module, args, kwargs, output) after module's forward."""
        self._undo.append(module.register_forward_hook(fn, with_kwargs=True).remove)

    def before(self, module: torch.nn.Module, fn) -> None:
        """fn(module, args, kwargs) before module's forward; returns None so inputs are untouched."""
        self._undo.append(module.register_forward_pre_hook(fn, with_kwargs=True).remove)

    def replace(self, obj, name: str, value, owner: str = "") -> None:
        """Set obj.name = value until exit; raises PatchConflict if another live patch holds obj.name."""
        self.apply([Replacement(obj, name, value, owner=owner)])

    def replace_item(self, mapping: dict, key, value, owner: str = "", label: str = "") -> None:
        """Set mapping[key] = value until exit (a registry entry, e.g. transformers' attention functions);
        raises PatchConflict if another live patch holds that entry."""
        self.apply([Replacement(mapping, key, value, item=True, owner=owner, label=label)])

    def apply(self, replacements: Iterable[Replacement]) -> None:
        """Check every replacement against the others and against every live one, then make them all: a
        conflict raises before anything has changed."""
        planned: dict[tuple, Replacement] = {}
        for r in replacements:
            held = planned.get(r.key) or _LIVE.get(r.key)
            same_value = held is not None and held.pooled and r.pooled and held.value is r.value
            if held is not None and not (r.key in planned and held.shared and r.shared) and not same_value:
                target = (r if r.label or not held.label else held).describe()  # whichever names it better
                raise PatchConflict(
                    f"{target} is replaced twice ({_who(held)} and {_who(r)}); two patches overlap: "
                    "undo the first (leave its `with` block or call its handle's remove()) before applying the second"
                )
            planned.setdefault(r.key, r)
        for r in planned.values():
            self._set(r)

    def _set(self, r: Replacement) -> None:
        if r.key in _LIVE:  # shared with another live HookSet (checked in apply): hold it, set nothing
            _HOLDERS[r.key] += 1
            self._undo.append(lambda: _let_go(r.key))
            return
        if r.item:
            had_own, previous = r.name in r.target, r.target.get(r.name)
            r.target[r.name] = r.value
        else:
            had_own, previous = r.name in vars(r.target), vars(r.target).get(r.name)
            setattr(r.target, r.name, r.value)
        _LIVE[r.key] = r
        _HOLDERS[r.key] = 1

        def restore() -> None:
            if r.item and had_own:
                r.target[r.name] = previous
            elif r.item:
                del r.target[r.name]
            elif had_own:
                setattr(r.target, r.name, previous)
            else:
                delattr(r.target, r.name)  # back to the class attribute (e.g. the class's forward)

        _RESTORE[r.key] = restore
        self._undo.append(lambda: _let_go(r.key))

    def remove(self) -> None:
        """Undo everything now (for callers that do not use `with`)."""
        self.__exit__(None, None, None)

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()


def after_call(method, emit):
    """`method` wrapped so that emit(args, kwargs, result) runs after each call: a seam on an object that is not an
    nn.Module (a MoE router), which has no forward hooks."""

    def wrapped(*args, **kwargs):
        result = method(*args, **kwargs)
        emit(args, kwargs, result)
        return result

    return wrapped


_RESTORE: dict[tuple, object] = {}  # how to put each live replacement's target back, run by its last holder


def _let_go(key: tuple) -> None:
    _HOLDERS[key] -= 1
    if _HOLDERS[key] == 0:
        del _HOLDERS[key], _LIVE[key]
        _RESTORE.pop(key)()


def _who(r: Replacement) -> str:
    return r.owner or "an unnamed patch"


def first_tensor(output) -> torch.Tensor:
    """vLLM layers return (tensor, extra) tuples, transformers' mostly tensors; taps want the tensor."""
    return output[0] if isinstance(output, (tuple, list)) else output


def arg(args: tuple, kwargs: dict, index: int, name: str) -> torch.Tensor:
    """A forward argument, whether it was passed by position or by keyword."""
    return args[index] if len(args) > index else kwargs[name]
