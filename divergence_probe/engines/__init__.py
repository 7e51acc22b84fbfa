"""Stack registry. A new stack (SGLang, Megatron) is one module plus one line here.

Entries are "module:Class" strings so a heavy engine is imported only when it is chosen.
"""

from __future__ import annotations

from importlib import import_module

from ..errors import ProbeError
from .protocol import (Capabilities, PromptScores, SamplingSpec, SequenceScores, Stack, StackInfo, StackSettings,
                       TapSink)

STACKS: dict[str, str] = {
    "vllm": "divergence_probe.engines.vllm.stack:VLLMStack",
    "hf": "divergence_probe.engines.hf.trainer:HFStack",
    "recorded": "divergence_probe.engines.recorded.stack:RecordedStack",  # score's inference side: a file, no flag
}
SHARDED: dict[str, str] = {  # the same stack over several processes (tensor parallel), where it has such a class
    "vllm": "divergence_probe.engines.vllm.tensor_parallel:TensorParallelStack",
    "hf": "divergence_probe.engines.hf.tensor_parallel:ShardedHFStack",
}
INFER_STACKS = ["vllm", "hf"]  # may sit on the inference side of a comparison
TRAIN_STACKS = ["hf"]  # may sit on the training side (a trainer's forward: transformers)


def register_stack(name: str, target: str, sides: tuple[str, ...] = ("infer", "train")):
    """Add a stack ("module:Class") on the given sides; returns a function that removes it again (tests use this
    for a toy stack; a stack that ships with the tool is a line in STACKS instead)."""
    STACKS[name] = target
    lists = [lst for side, lst in (("infer", INFER_STACKS), ("train", TRAIN_STACKS)) if side in sides]
    for lst in lists:
        lst.append(name)

    def unregister() -> None:
        STACKS.pop(name, None)
        for lst in lists:
            lst.remove(name)

    return unregister


def stack_class(name: str, ranks: int = 1) -> type:
    """The class of a stack by registry name, at `ranks` processes; imported, never instantiated (no engine library
    is imported: every stack imports its engine when it loads)."""
    if name not in STACKS:
        raise ProbeError(f"unknown stack {name!r}; choose one of: {', '.join(STACKS)}")
    module, cls = (SHARDED[name] if ranks > 1 and name in SHARDED else STACKS[name]).split(":")
    return getattr(import_module(module), cls)


def capabilities_of(name: str, *, engine: str = "eager", ranks: int = 1) -> Capabilities:
    """What a stack declares it can do (protocol.Capabilities), before anything loads: what a spec check asks."""
    return stack_class(name, ranks).declare(engine, ranks)


def get_stack(name: str) -> Stack:
    """A fresh, unloaded stack instance by registry name."""
    return stack_class(name)()


__all__ = ["STACKS", "SHARDED", "INFER_STACKS", "TRAIN_STACKS", "capabilities_of", "get_stack", "register_stack",
           "stack_class", "Capabilities", "PromptScores", "SamplingSpec", "SequenceScores", "Stack", "StackInfo",
           "StackSettings", "TapSink"]
