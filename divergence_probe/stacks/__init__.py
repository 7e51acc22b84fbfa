"""Stack registry. A new stack (SGLang, Megatron) is one module plus one line here.

Entries are "module:Class" strings so a heavy engine is imported only when it is chosen.
"""

from __future__ import annotations

from importlib import import_module

from ..errors import ProbeError
from .base import PromptScores, SamplingSpec, SequenceScores, Stack, StackInfo, StackSettings, TapSink

STACKS: dict[str, str] = {
    "vllm": "divergence_probe.stacks.vllm:VLLMStack",
    "hf": "divergence_probe.stacks.hf:HFStack",
}
INFER_STACKS = ("vllm", "hf")  # may sit on the inference side of a comparison
TRAIN_STACK = "hf"  # the training side is always transformers


def get_stack(name: str) -> Stack:
    """A fresh, unloaded stack instance by registry name."""
    if name not in STACKS:
        raise ProbeError(f"unknown stack {name!r}; choose one of: {', '.join(STACKS)}")
    module, cls = STACKS[name].split(":")
    return getattr(import_module(module), cls)()


__all__ = ["STACKS", "INFER_STACKS", "TRAIN_STACK", "get_stack", "PromptScores", "SamplingSpec", "SequenceScores", "Stack", "StackInfo",
           "StackSettings", "TapSink"]
