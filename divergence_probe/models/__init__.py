"""Model families by config.json's `model_type`. A new family (Qwen3-MoE, Llama) is one module plus one line here,
and one layout entry in each engine's layouts.py.

Entries are "module:NAME" strings, imported when a family is first asked for (vLLM's lazy model registry).
"""

from __future__ import annotations

from importlib import import_module

from ..errors import ModelError
from .base import ExpertTensors, Family, dims, find

FAMILIES: dict[str, str] = {
    "qwen2": "divergence_probe.models.qwen2:QWEN2",
    "qwen3": "divergence_probe.models.qwen3:QWEN3",
    "qwen3_moe": "divergence_probe.models.qwen3_moe:QWEN3_MOE",
}


def get_family(model_type: str) -> Family:
    """The family description of a config.json model_type; an unknown one is a one-line error listing the known."""
    if model_type not in FAMILIES:
        raise ModelError(f"unknown model_type {model_type!r}; divergence-probe knows: {', '.join(FAMILIES)}")
    module, attr = FAMILIES[model_type].split(":")
    return getattr(import_module(module), attr)


def family_of(model) -> Family:
    """The family of a loaded model of any engine (each keeps the transformers config as `model.config`)."""
    return get_family(model.config.model_type)


__all__ = ["FAMILIES", "ExpertTensors", "Family", "dims", "family_of", "find", "get_family"]
