"""The vLLM engine args a run folder may replay without asking (rerun), and those it may not.

A run folder is data from whoever made it, and some of vLLM's engine arguments load or run code: `trust_remote_code`
with a model folder whose config has an `auto_map`, a worker or scheduler class, a plugin, a model loader,
hf_overrides, a tokenizer or download path elsewhere, a compile backend or inductor pass named by its Python path.
Which arguments only set numerics, scheduling or compilation and take plain values is knowledge of vLLM's EngineArgs,
so it lives with the vLLM engine; rerun asks it.
"""

from __future__ import annotations

import re
from typing import Iterable

# vllm.LLM / EngineArgs keywords that change how the engine schedules, caches or compiles the same model, and that
# take plain values only. Read from vllm/engine/arg_utils.py EngineArgs (0.32); the ones divergence-probe sets
# itself (dtype, seed, max_model_len, enforce_eager, ...) are refused by args.check_engine_args anyway.
REPLAYED = frozenset({
    "compilation_config",  # its keys are checked too: COMPILATION_REPLAYED
    "max_num_seqs", "max_num_scheduled_tokens", "block_size", "enable_prefix_caching", "prefix_caching_hash_algo",
    "enable_chunked_prefill", "long_prefill_token_threshold", "gpu_memory_utilization", "kv_cache_memory_bytes",
    "num_gpu_blocks_override", "kv_cache_dtype", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
    "disable_cascade_attn", "disable_sliding_window", "attention_backend", "async_scheduling", "scheduling_policy",
    "max_logprobs", "logprobs_mode", "disable_log_stats", "optimization_level", "performance_mode",
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_flashinfer_autotune",
})
# CompilationConfig fields that choose modes and sizes. Not: backend other than inductor/eager (a Python path
# to import), inductor_passes (Python paths), inductor_compile_config (inductor options include the C++ compiler
# to run), cache_dir and debug_dump_path (paths outside the run: a cache holds compiled code that is loaded),
# splitting_ops.
COMPILATION_REPLAYED = frozenset({
    "mode", "cudagraph_mode", "custom_ops", "compile_sizes", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
    "cudagraph_num_of_warmups", "cudagraph_copy_inputs", "use_inductor_graph_partition", "pass_config",
    "dynamic_shapes_config", "compile_ranges_endpoints", "backend",
})
_BACKENDS = ("", "inductor", "eager")
_NAME = re.compile(r"[A-Za-z0-9_+\-]*")  # a mode or op name; no path, no module.attribute, no URL


def _plain(value, depth: int = 0) -> bool:
    """A number, a boolean, null, a name, or a list (or, one level down, an object) of those."""
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, str):
        return _NAME.fullmatch(value) is not None
    if isinstance(value, list):
        return depth < 2 and all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return depth < 1 and all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def refused_engine_args(engine_args: dict, allowed: Iterable[str] = ()) -> list[str]:
    """The engine args (dotted for a compilation_config key) that rerun does not replay without asking."""
    allowed = set(allowed)
    refused = []
    for key, value in engine_args.items():
        if key in allowed:
            continue
        if key not in REPLAYED:
            refused.append(key)
        elif key == "compilation_config" and isinstance(value, dict):
            for sub, sub_value in value.items():
                name = f"{key}.{sub}"
                if name in allowed:
                    continue
                if sub not in COMPILATION_REPLAYED or not _plain(sub_value) \
                        or (sub == "backend" and sub_value not in _BACKENDS):
                    refused.append(name)
        elif not _plain(value) or (key == "compilation_config" and not isinstance(value, int)):
            refused.append(key)
    return refused
