"""A second engine in one folder: a dense Qwen2/Qwen3 decoder in plain torch (model.py) behind the engine protocol
(stack.py), with its region patches (patches.py). The package never names it: `register()` puts it in the
registry as the `second` inference stack, and from then on the CLI and the Python API run it as they run vLLM.

    remove = second_engine.register()
    divergence-probe compare --infer second --batch-invariance ...      # or ablate --regions swiglu --side infer
    remove()

Installed as a package of its own, an engine names its class in an entry point instead, and every run finds it
without a call (engines.ENTRY_POINTS):

    [project.entry-points."divergence_probe.stacks"]
    second = "second_engine.stack:SecondStack"
"""

from __future__ import annotations

from typing import Callable

from divergence_probe.engines import register_stack

from .stack import NAME, SecondStack

TARGET = f"{__name__}.stack:{SecondStack.__name__}"  # its registry entry, and its entry point's value


def register() -> Callable[[], None]:
    """Register the engine on the sides its class declares; returns the function that removes it again."""
    return register_stack(NAME, TARGET, sides=SecondStack.sides)


__all__ = ["NAME", "TARGET", "SecondStack", "register"]
