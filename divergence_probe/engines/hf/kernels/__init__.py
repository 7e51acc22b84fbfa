"""Trainer kernel sets: which ops the trainer's forward runs (`--train-kernels`). A new set is one module defining a
`KernelSet` plus one line in KERNELS.

Entries are "module:attribute" strings so a set's library (vLLM, Liger-Kernel) is imported only when it is chosen.
"""

from __future__ import annotations

from importlib import import_module

from ....errors import ProbeError

KERNELS: dict[str, str] = {
    "torch": "divergence_probe.engines.hf.kernels.torch_ops:TORCH",
    "vllm": "divergence_probe.engines.vllm.trainer_kernels:VLLM",
    "liger": "divergence_probe.engines.hf.kernels.liger:LIGER",
}
SHIPPED = "torch"  # transformers' own ops: the trainer as it ships


def get_kernels(name: str):
    """The KernelSet (kernels/base.py) registered as `name`. Its module is imported here, so the registry itself
    imports no kernel set and stays below the specs that check a name against it."""
    if name not in KERNELS:
        raise ProbeError(f"--train-kernels {name!r} is not a kernel set; choose one of: {', '.join(KERNELS)}")
    module, attr = KERNELS[name].split(":")
    return getattr(import_module(module), attr)


__all__ = ["KERNELS", "SHIPPED", "get_kernels"]
