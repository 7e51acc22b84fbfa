"""transformers' own eager PyTorch ops: the trainer as it ships, nothing replaced."""

from __future__ import annotations

from .base import KernelSet

TORCH = KernelSet(name="torch", summary="transformers' eager PyTorch ops, as shipped", plan=lambda model: [])
