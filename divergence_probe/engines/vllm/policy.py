"""vLLM's pre-load policy (engines/protocol.py StackClass): what the engine decides before anything loads. Its stack
classes (stack.py VLLMStack, tensor_parallel.py, worker.py) inherit it, so the specs, the load and the runs ask the class
the registry hands out and never import these modules. Imports no vLLM until a check asks the installed library.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from ...environment import cpu_kv_cache_gib, resolve_device
from ..protocol import ENGINE_MODES, Knob, LoadPlan, StackPolicy, StackSettings
from .knobs import KNOBS, OWNED_ENGINE_ARGS, check_knobs, quantized
from .replayable import refused_engine_args

ARG = "tensor_parallel_size"
GiB = 1 << 30


def ranks_of(engine_args: Mapping[str, object]) -> int:
    """The engine's tensor-parallel size from its engine args (1 when not given)."""
    value = engine_args.get(ARG)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1  # another type: check_engine_args


class VLLMPolicy(StackPolicy):
    name = "vllm"
    title = "vLLM"
    workers = True
    released = ("shut down: the engine ran in a worker process of its own, which exited before the trainer loaded "
                "(its device and host memory returned)")
    modes = ENGINE_MODES
    libraries = ("vllm",)
    owned_args = OWNED_ENGINE_ARGS
    patches = "divergence_probe.engines.vllm.patches:PATCHES"
    aligns = ("rope", "swiglu", "rmsnorm", "lm_head", "residual")  # patches/: PATCHES

    @classmethod
    def check_settings(cls, load, *, imports: bool = False) -> None:
        """The knobs it measures (FP8 settings this device or build cannot run) from the settings alone; with
        `imports`, every arg against the installed vLLM's keywords and what capture cannot live with."""
        if quantized(load.engine_args):
            check_knobs(load.engine_args, resolve_device(load.device))
        if imports and load.engine_args:
            from .args import check_engine_args

            check_engine_args(load.engine_args, load.engine)

    @classmethod
    def ranks(cls, engine_args: Mapping[str, object]) -> int:
        return ranks_of(engine_args)

    @classmethod
    def knobs(cls) -> Mapping[str, Knob]:
        knobs = [Knob("engine", knob.key, knob.factor_values, knob.load_field, knob.change, knob.check, knob.summary)
                 for knob in KNOBS.values()]
        return {knob.name: knob for knob in knobs}

    @classmethod
    def refused_replay(cls, engine_args: Mapping[str, object], allowed: Sequence[str] = ()) -> list[str]:
        return refused_engine_args(dict(engine_args), allowed)

    @classmethod
    def plan(cls, settings: StackSettings, *, family=None, taps: str | None = None, routes: bool = False,
             size=None, total_bytes: int = 0, stacks_on_device: int = 1, budget: tuple[int, float] | None = None
             ) -> LoadPlan:
        """A compiled engine's tap points; its KV cache: VLLM_CPU_KVCACHE_SPACE on the CPU (vLLM CPU's platform sets
        kv_cache_memory_bytes from it over any engine arg), the user's kv_cache_memory_bytes, or what the user's
        gpu_memory_utilization leaves of the device once the weights on it are counted (vLLM's share counts them all).
        With the memory plan's `budget` (KV bytes, the engine's share of the device) on CUDA, the args that size it:
        vLLM 0.24 still checks at start-up that gpu_memory_utilization x total memory is free, even when
        kv_cache_memory_bytes is given, so the share asked is the engine's part of the plan."""
        from .compiled_taps import tap_points_for

        user = settings.engine_kwargs()
        fixed = user.get("kv_cache_memory_bytes")
        if settings.device == "cpu":
            fixed = cpu_kv_cache_gib() * GiB
        elif fixed is None and "gpu_memory_utilization" in user and settings.device == "cuda" and size is not None:
            fixed = max(0, int(user["gpu_memory_utilization"] * total_bytes)
                        - stacks_on_device * size.parameters * settings.dtype.itemsize)
        kv_dtype_bytes = 1 if str(user.get("kv_cache_dtype", "")).startswith("fp8") else settings.dtype.itemsize
        engine_args: dict[str, object] = {}
        if budget is not None and settings.device == "cuda" and not fixed:
            engine_args["kv_cache_memory_bytes"] = budget[0]
            if "gpu_memory_utilization" not in user:
                engine_args["gpu_memory_utilization"] = budget[1]
        return LoadPlan(taps=tap_points_for(taps, settings, family, routes=routes), ranks=ranks_of(user),
                        kv_bytes_per_token=size.kv_bytes_per_token(kv_dtype_bytes) if size is not None else None,
                        kv_cache_bytes=fixed, share=user.get("gpu_memory_utilization")
                        if settings.device == "cuda" else None, engine_args=engine_args)

    @classmethod
    def for_settings(cls, settings: StackSettings, regions: Sequence[str] | None = None):
        """In this process, over tensor_parallel_size ranks where the args ask for more than one, or (`regions`) an
        engine built with those regions in a worker process of its own."""
        from .. import stack_class

        if regions is not None:
            return stack_class(cls.name, worker=True)(settings, tuple(regions))
        return stack_class(cls.name, ranks_of(settings.engine_kwargs()))()

    @classmethod
    def unsharded(cls, settings: StackSettings) -> StackSettings:
        """These engine settings at tensor_parallel_size 1: the parallelism floor's engine."""
        return replace(settings, engine_args=tuple((k, v) for k, v in settings.engine_args if k != ARG))

    @classmethod
    def other_mode(cls, settings: StackSettings) -> StackSettings:
        """These engine settings in the other engine mode (the engine noise floor's); eager compiles nothing, so a
        compilation_config the user passed for the compiled engine is left out of it."""
        other = "eager" if settings.engine == "compiled" else "compiled"
        args = tuple((k, v) for k, v in settings.engine_args if not (k == "compilation_config" and other == "eager"))
        return replace(settings, engine=other, engine_args=args, engine_taps=frozenset())
