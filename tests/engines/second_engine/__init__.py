"""A second engine in one folder: a dense Qwen2/Qwen3 decoder in plain torch (model.py) behind the engine protocol
(stack.py), with its region patches (patches.py). The package never names it: `register()` puts it in the
registry as the `second` inference stack, and from then on the CLI and the Python API run it as they run vLLM.

    remove = second_engine.register()
    divergence-probe compare --infer second --batch-invariance ...      # or ablate --regions swiglu --side infer
    remove()

An engine installed as a package of its own makes the same call before the tool runs (from a script over the Python
API, say).
"""

from __future__ import annotations

from typing import Callable

from divergence_probe.engines import register_stack

from .stack import NAME, SecondStack


def register() -> Callable[[], None]:
    """Register the engine on the inference side; returns the function that removes it again."""
    return register_stack(NAME, f"{__name__}.stack:{SecondStack.__name__}", sides=("infer",))


__all__ = ["NAME", "SecondStack", "register"]
