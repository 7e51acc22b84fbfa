"""Stack registry. A new stack (SGLang, Megatron) is one package plus one line here.

Entries are "module:Class" strings so a heavy engine is imported only when it is chosen. The class an entry hands out
declares what it can do (`declare`) and owns its pre-load policy (protocol.StackClass): its settings check, knobs,
replayable args, load plan and the variant it builds for given settings (`for_settings`). Outside engines/, only this
module and protocol.py are imported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import import_module

from ..errors import ProbeError

# The types below are engines/protocol.py's (Capabilities, Knob, Stack, StackClass); the registry does not import them,
# so that a spec asking it for a class sits no deeper in the import graph than the registry itself.

STACKS: dict[str, str] = {
    "vllm": "divergence_probe.engines.vllm.stack:VLLMStack",
    "hf": "divergence_probe.engines.hf.trainer:HFStack",
    "recorded": "divergence_probe.engines.recorded.stack:RecordedStack",  # score's inference side: a file, no flag
}
SHARDED: dict[str, str] = {  # the same stack over several processes (tensor parallel), where it has such a class
    "vllm": "divergence_probe.engines.vllm.tensor_parallel:TensorParallelStack",
    "hf": "divergence_probe.engines.hf.tensor_parallel:ShardedHFStack",
}
WORKERS: dict[str, str] = {  # the same stack built with regions in a worker process of its own (StackClass.workers)
    "vllm": "divergence_probe.engines.vllm.worker:WorkerStack",
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


def stack_class(name: str, ranks: int = 1, *, worker: bool = False):
    """The class of a stack by registry name, at `ranks` processes (`worker`: its worker-process variant); imported,
    never instantiated (no engine library is imported: every stack imports its engine when it loads). A caller
    that has settings asks `stack_class(name).for_settings(settings)` for the variant they need."""
    if name not in STACKS:
        raise ProbeError(f"unknown stack {name!r}; choose one of: {', '.join(STACKS)}")
    entry = WORKERS[name] if worker else SHARDED[name] if ranks > 1 and name in SHARDED else STACKS[name]
    module, cls = entry.split(":")
    return getattr(import_module(module), cls)


def knobs_of(infer: str | None = None, train: str | None = None) -> dict:
    """The deployment knobs, by name (`engine:kv_cache_dtype`): the engine side's of the inference stacks, the
    training side's of the trainers, each marked with the stack that owns it; `infer`/`train`: those stacks only."""
    found = {}
    for side, names in (("engine", [infer] if infer else INFER_STACKS), ("train", [train] if train else TRAIN_STACKS)):
        for name in names:
            for knob in stack_class(name).knobs().values():
                if knob.side == side:
                    found.setdefault(knob.name, replace(knob, owner=name))
    return found


# Deployment knobs as ablation factors (`--factor SIDE:KEY=VALUE`, spec/knobs.py): a factor is one value of a knob a
# stack declares, read here against the knobs the registry's stacks declare.
FACTOR_SIDES = ("engine", "train")


@dataclass(frozen=True)
class Factor:
    knob: object  # engines.protocol.Knob, as the stack that owns it declares it
    value: str

    @property
    def label(self) -> str:
        """How combinations and the attribution name it: engine:kv_cache_dtype=fp8."""
        return f"{self.knob.name}={self.value}"


def parse_factor(text: str) -> Factor:
    """'engine:kv_cache_dtype=fp8' -> its Factor; anything else is one line naming what a factor looks like."""
    name, eq, value = text.strip().partition("=")
    knobs = knobs_of()
    if not eq or name not in knobs:
        side = name.partition(":")[0]
        hint = f"knobs: {', '.join(knobs)}" if side in FACTOR_SIDES else "a region goes in --regions"
        raise ProbeError(f"--factor {text.strip()!r} is not SIDE:KEY=VALUE of a known knob ({hint}), e.g. "
                         "engine:kv_cache_dtype=fp8 or train:kernels=vllm")
    knob = knobs[name]
    if value not in knob.values:
        raise ProbeError(f"--factor {name}={value!r}: {name} takes {', '.join(knob.values)}")
    return Factor(knob, value)


def parse_factors(texts) -> tuple[str, ...]:
    """--factor's values (repeated, each possibly a comma list) -> the factors' labels, checked, without repeats;
    two values of one knob cannot both be factors (a combination would set it twice)."""
    items = [t for text in ([texts] if isinstance(texts, str) else list(texts or ())) for t in text.split(",") if t.strip()]
    factors = [parse_factor(t) for t in items]
    seen: dict[str, str] = {}
    for f in factors:
        if seen.get(f.knob.name, f.label) != f.label:
            raise ProbeError(f"--factor {seen[f.knob.name]} and {f.label} set the same knob; ablate one value of a "
                             "knob at a time")
        seen[f.knob.name] = f.label
    return tuple(dict.fromkeys(f.label for f in factors))


def capabilities_of(name: str, *, engine: str = "eager", ranks: int = 1):
    """What a stack declares it can do (protocol.Capabilities), before anything loads: what a spec check asks."""
    return stack_class(name, ranks).declare(engine, ranks)


def get_stack(name: str):
    """A fresh, unloaded stack instance by registry name."""
    return stack_class(name)()


__all__ = ["STACKS", "SHARDED", "WORKERS", "INFER_STACKS", "TRAIN_STACKS", "Factor", "capabilities_of", "get_stack",
           "knobs_of", "parse_factor", "parse_factors", "register_stack", "stack_class"]
