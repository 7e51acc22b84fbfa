"""A vLLM engine built with regions aligned: the patches go in before the engine compiles, and the build proves it.

A compiled engine traces its modules once, at its first (warm-up) forward inside `vllm.LLM(...)`; a patch made
after that changes nothing the engine runs. So the region patches are applied from inside the engine build: the
model runner's `load_model` is wrapped for the duration of `vllm.LLM(...)` and patches the model it has just
built, before the warm-up run that compiles it. In compiled mode Dynamo then traces the patched `_forward_method`s
(vLLM's CustomOp.forward calls them; with `custom_ops=['none']` they would otherwise be `forward_native`) and
Inductor compiles the aligned code. The build then proves the aligned functions are in the compiled graph: every
replacement's code object must have been inlined by Dynamo in this process, or be listed in the inlined sources of
the AOT artifact vLLM loaded from its cache. Otherwise the engine runs other code than the region says and the
build is refused.

The compile cache must never serve one combination's graph to another: see `cache_namespace`.
"""

from __future__ import annotations

import inspect
import sys
from typing import Sequence

import torch

from ...errors import StackError
from ..protocol import StackSettings
from ..hooks import HookSet
from .cache_root import namespace, sources

CACHE_SUBDIR = "divergence_probe_aligned"  # under VLLM_CACHE_ROOT; one folder per aligned-region set


def cache_namespace(regions: Sequence[str], root: str | None = None) -> str | None:
    """The VLLM_CACHE_ROOT an engine with `regions` aligned must compile into, or None for the shipped engine.

    vLLM's AOT compile cache (on by default with torch >= 2.10) is keyed by the vLLM config, its compile-relevant
    environment variables and the model forward's name: not by which Python code the trace inlined. A region patch
    changes none of those, so an aligned build and a shipped build share one key, and whichever compiled first would
    be loaded by the other (vLLM re-checks only that the inlined source files are unchanged, which they are). The
    key's only lever outside the config is where the cache lives, so each set of aligned regions compiles under its
    own VLLM_CACHE_ROOT: a subfolder of the user's root named by the regions and the sha256 of their vLLM patches'
    source files and of the modules those take code from (an edited region compiles anew; residual runs rmsnorm's
    norm).
    The shipped engine keeps the user's root, which it can share with the user's own vLLM runs. Inductor's own
    caches are keyed by graph content and follow VLLM_CACHE_ROOT in AOT mode."""
    if not regions:
        return None
    from ..patching import patches_of

    parts = [(name, sources(inspect.getmodule(patches_of("vllm")[name]))) for name in sorted(regions)]
    return namespace(CACHE_SUBDIR, "+".join(sorted(regions)), parts, root)


def _runner_classes() -> list[type]:
    """The model runner classes whose load_model builds the model (CPU, CUDA, and the CUDA model runner V2 vLLM
    picks for some models), where this vLLM has them."""
    found = []
    for module, name in (("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
                         ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
                         ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner")):  # model runner V2 (Qwen3, 0.24 CUDA)
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
        if "load_model" in vars(cls):
            found.append(cls)
    if not found:
        raise StackError("cannot find vLLM's model runner (load_model) to align regions before the engine compiles; "
                         "divergence-probe knows vLLM 0.24 (CUDA) and 0.32 (CPU)")
    return found


class _InlineRecorder:
    """Every code object Dynamo inlines while tracing, in this process (vLLM wraps the same method while it
    compiles, and calls through whatever it found, so both see every inline)."""

    def __init__(self, hooks: HookSet) -> None:
        from torch._dynamo.symbolic_convert import InliningInstructionTranslator

        self.codes: set[tuple[str, int]] = set()
        original = InliningInstructionTranslator.inline_call_

        def inline_call_(tracer):
            code = tracer.f_code
            self.codes.add((code.co_filename, code.co_firstlineno))
            return original(tracer)

        hooks.replace(InliningInstructionTranslator, "inline_call_", inline_call_, owner="aligned engine build")


def _aot_sources(model: torch.nn.Module) -> set[tuple[str, int]]:
    """(file, first line) of every function the AOT-compiled graph(s) of `model` inlined, as their artifact records."""
    found = set()
    for module in model.modules():
        compiled = getattr(module, "aot_compiled_fn", None)
        info = getattr(compiled, "source_info", None)
        if not callable(info):
            continue
        for source in info().inlined_sources:
            owner = sys.modules.get(source.module)
            if owner is not None and getattr(owner, "__file__", None):
                found.add((owner.__file__, source.firstlineno))
    return found


def load_aligned(stack, settings: StackSettings, regions: Sequence[str]):
    """`stack`, an unloaded VLLMStack, loaded with its engine built with `regions` patched in before it compiled (the
    caller imports vLLM first: the worker, which holds the stack). The patches stay in place for the life of the
    process (the engine keeps running that code; eager mode calls it at every step). Raises StackError when a region's
    aligned code is not in the compiled graph."""
    from ..patching import plan

    hooks = HookSet()  # never undone: the process exists to run this engine
    planned: dict[str, list] = {}
    recorder = _InlineRecorder(hooks) if settings.engine == "compiled" and regions else None

    def patch(model: torch.nn.Module) -> None:
        if planned or not regions:
            return
        plans = plan("vllm", model, regions)
        hooks.apply([r for found in plans.values() for r in found])
        planned.update(plans)

    for cls in _runner_classes():
        original = cls.load_model

        def load_model(self, *args, _original=original, **kwargs):
            result = _original(self, *args, **kwargs)
            model = self.get_model() if callable(getattr(self, "get_model", None)) else self.model
            patch(model)
            return result

        hooks.replace(cls, "load_model", load_model, owner="aligned engine build")
    stack.load(settings)
    if regions and not planned:
        raise StackError("vLLM built its model without calling the model runner's load_model; the regions could not "
                         "be patched before the engine compiled: report this as a bug")
    stack.aligned_in_engine = _check_compiled(stack, planned, recorder)
    return stack


def _check_compiled(stack, planned: dict[str, list], recorder: _InlineRecorder | None) -> dict[str, str]:
    """Per region, how the engine runs its aligned code; refuse a region the compiled graph does not contain."""
    if recorder is None:
        return {name: "patched (eager: runs as Python at every step)" for name in planned}
    from ...regions import get_region

    inlined, loaded = recorder.codes, _aot_sources(stack.model)
    status = {}
    for name, replacements in planned.items():
        if get_region(name).outside_graph:
            status[name] = "patched (outside the compiled graph: runs as Python at every step)"
            continue
        codes = {(r.value.__code__.co_filename, r.value.__code__.co_firstlineno) for r in replacements
                 if inspect.isfunction(r.value) or inspect.ismethod(r.value)}
        if codes & inlined:
            status[name] = "compiled (traced into the engine's graph at this build)"
        elif codes & loaded:
            status[name] = "compiled (loaded from vLLM's compile cache, whose graph inlined it)"
        else:
            raise StackError(f"region {name} was patched before the engine compiled, but its aligned code is not in "
                             "vLLM's compiled graph (this vLLM dispatches the op elsewhere, or its compile cache "
                             f"served another graph); leave {name} out of the engine-side regions (--side train) or "
                             "use --engine eager")
    return status
