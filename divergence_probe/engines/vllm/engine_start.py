"""The one vLLM engine of this process, started: what makes an engine (its key, its tap points), the keywords
`LLM(...)` gets, the compile cache root of a tapped build, the sampler fallback without flashinfer, the rendezvous
files a failed start leaves, and the in-process runner the stack reaches the model through."""

from __future__ import annotations

import atexit
import contextlib
import os

import torch

from ...errors import StackError
from ..protocol import StackSettings
from . import compiled_taps


def _engine_key(settings: StackSettings) -> tuple:
    """What makes an engine: the training-side fields (train_attn, train_sdpa) may differ between probes."""
    return (settings.model_path, settings.dtype, settings.device, settings.seed, settings.max_model_len,
            settings.batch_tokens, settings.engine, settings.engine_args, _tap_points(settings))


def _tap_points(settings: StackSettings) -> frozenset[str]:
    """The layer taps the engine is built with tap points and buffers for (compiled mode only: eager taps are plain
    hooks). An engine without them is vLLM exactly as deployed; one with them is another engine (another compiled
    graph, and buffers for these taps)."""
    return frozenset(settings.engine_taps) if settings.engine == "compiled" else frozenset()


def _disable_flashinfer_sampler_if_missing() -> None:
    """vLLM 0.24 on CUDA imports flashinfer unguarded when it builds its top-k/top-p sampler. Only when
    flashinfer is absent, tell vLLM the sampler is unsupported so it takes its PyTorch fallback."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        try:  # the seam: a vLLM without this sampler switch has nothing to switch off
            from vllm.v1.sample.ops import topk_topp_sampler
            from vllm.v1.sample.ops.topk_topp_sampler import flashinfer_sampler_supported  # noqa: F401
        except ImportError:
            return
        topk_topp_sampler.flashinfer_sampler_supported = lambda: False


_DIST_FILES: list[str] = []  # the rendezvous files this process's engine start created


def _track_dist_files() -> None:
    """Record the path of the rendezvous file vLLM 0.32's single-process executor creates in the temp folder
    (vllm_dist_<uuid>, utils/network_utils.get_file_store_init_method), so that it can be removed: torch's
    FileStore deletes it only when the store is destroyed, which a failed engine start or a process killed by a
    signal never does. Only this process's own files are touched; other processes' engines keep theirs."""
    try:
        from vllm.v1.executor import uniproc_executor
    except ImportError:
        return
    make = getattr(uniproc_executor, "get_file_store_init_method", None)
    if make is None or getattr(make, "tracked", False):  # vLLM 0.24 rendezvous over TCP: no file
        return

    def tracked() -> str:
        method = make()
        _DIST_FILES.append(method.removeprefix("file://"))
        return method

    tracked.tracked = True
    uniproc_executor.get_file_store_init_method = tracked
    atexit.register(_remove_dist_files)  # after a signal or at exit; FileStore tolerates its file being gone


def _remove_dist_files() -> None:
    while _DIST_FILES:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_DIST_FILES.pop())


def _find_runner(llm):
    """The in-process model runner; the attribute path moves between releases, so it is looked up here only."""
    paths = [
        ("model_executor", "driver_worker", "worker", "model_runner"),
        ("engine_core", "engine_core", "model_executor", "driver_worker", "worker", "model_runner"),
    ]
    for path in paths:
        obj = llm.llm_engine
        for name in path:
            obj = getattr(obj, name, None)
        if isinstance(getattr(obj, "model", None), torch.nn.Module) or callable(getattr(obj, "get_model", None)):
            return obj
    raise StackError(
        "cannot reach vLLM's model in-process (is VLLM_ENABLE_V1_MULTIPROCESSING=0 honoured by this vLLM "
        "version?); divergence-probe knows vLLM 0.24 (CUDA) and 0.32 (CPU)"
    )


@contextlib.contextmanager
def _building(settings: StackSettings, tap_points: "compiled_taps.TapPoints | None"):
    """While `LLM(...)` builds a compiled engine with tap points: the model gets them before its first forward
    compiles it, and vLLM's compile cache is off for this build. Its keys (the AOT artifact's: config and the
    model's forward; the backend's: config and the traced files) cannot tell a tapped graph from an untapped one, so
    a tapped build neither loads an artifact (it could be untapped: no taps, or taps from another graph) nor saves
    one (an untapped run could load it: not vLLM as deployed); a cache root of its own would keep them apart, but
    vLLM 0.24 on CUDA cannot serialize the tapped graph at all. Inductor's own FX graph cache stays on: it is keyed
    by the graph itself. VLLM_DISABLE_COMPILE_CACHE is read while the engine starts, before vLLM freezes its
    environment cache, and restored afterwards."""
    if not _tap_points(settings):
        yield
        return
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    before = os.environ.get("VLLM_DISABLE_COMPILE_CACHE")
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    try:
        with tap_points.building([Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM],
                                 _tap_points(settings)):
            yield
    finally:
        if before is None:
            os.environ.pop("VLLM_DISABLE_COMPILE_CACHE", None)
        else:
            os.environ["VLLM_DISABLE_COMPILE_CACHE"] = before


def _engine_kwargs(settings: StackSettings) -> dict:
    """vllm.LLM keywords: what the tool needs, the mode's settings, then the user's engine args verbatim."""
    kwargs = dict(
        model=settings.model_path,
        skip_tokenizer_init=True,  # we send token ids (an engine arg may load the tokenizer: it changes no id we send)
        dtype=str(settings.dtype).removeprefix("torch."),
        seed=settings.seed,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=max(settings.batch_tokens, settings.max_model_len),
        # Without a memory plan: a share of the device. probe.load's plan (runs/memory.py) replaces it on CUDA, through
        # the engine args, by kv_cache_memory_bytes sized to the run and the share the engine's part of the plan is
        # (vLLM 0.24 still checks that share is free at start-up). On the CPU the KV cache is VLLM_CPU_KVCACHE_SPACE.
        gpu_memory_utilization=0.3 if settings.device == "cpu" else 0.5,
    )
    if settings.engine == "eager":  # today's laboratory engine: every module runs in Python, one whole step
        kwargs.update(enforce_eager=True, enable_prefix_caching=False, enable_chunked_prefill=False)
    kwargs.update(settings.engine_kwargs())
    return kwargs
