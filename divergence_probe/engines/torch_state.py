"""Torch's process-wide numerics state: a snapshot taken before vLLM is imported, and a context that runs the trainer under it.

Why: vLLM and the training stack share one process, and torch keeps its numerics switches (SDPA backends, TF32 and
reduced-precision flags, matmul precision, deterministic algorithms, threads, default dtype) per process. `import vllm`
and vLLM's engine start change some of them (on CUDA `torch.backends.cuda.enable_cudnn_sdp(False)` at import, the
float32 matmul precision and one intra-op thread at worker start; on CPU the worker replaces `torch.set_num_threads`
by a no-op), so a transformers forward run after them is not what a trainer process, which never imports vLLM, runs.

When the snapshot is taken: at the first of (a) the vLLM stack's `_import_vllm`, just before `import vllm`, or (b) the
first training forward. Taking it that late, rather than when this package is imported, keeps whatever the user set
up before loading (their own TF32 or thread settings are part of "their trainer"); taking it no later than the
import is what makes it free of vLLM. If vLLM was imported before the snapshot (by the user's own code), the
snapshot holds whatever vLLM left behind: `origin()` says so and the manifest records it.

Every flag is set through torch's own C setters, only where it differs: vLLM's CPU worker replaces the public
`torch.set_num_threads` with a no-op, and setting TF32 through both torch's legacy and new APIs is refused.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator

import torch

from ..errors import StackError

SDPA_BACKENDS = ("auto", "math", "flash", "efficient", "cudnn")
_SDPA_ENUM = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
_CPU_SDPA = ("auto", "math", "flash")  # torch has no memory-efficient or cuDNN attention kernel on the CPU


def _flags() -> dict[str, tuple[Callable[[], object], Callable[[object], None]]]:
    """name -> (getter, setter) for every numerics switch this torch build has (names follow torch's public API)."""
    C, cuda = torch._C, torch.backends.cuda
    table: dict[str, tuple[Callable[[], object], Callable[[object], None]]] = {}  # set in this order

    def add(name: str, get_name: str, set_name: str, module=C) -> None:
        get, set_ = getattr(module, get_name, None), getattr(module, set_name, None)
        if get is not None and set_ is not None:
            table[name] = (get, set_)

    add("float32_matmul_precision", "get_float32_matmul_precision", "set_float32_matmul_precision", torch)
    add("cuda.matmul.allow_tf32", "_get_cublas_allow_tf32", "_set_cublas_allow_tf32")
    add("cudnn.allow_tf32", "_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32")
    for half in ("fp16", "bf16"):  # (allow, allow_split_k): the getter returns both, the setter takes both
        get = getattr(C, f"_get_cublas_allow_{half}_reduced_precision_reduction", None)
        set_ = getattr(C, f"_set_cublas_allow_{half}_reduced_precision_reduction", None)
        if get is not None and set_ is not None:
            table[f"cuda.matmul.allow_{half}_reduced_precision_reduction"] = (get, lambda v, s=set_: s(*v))
    add("cuda.matmul.allow_fp16_accumulation", "_get_cublas_allow_fp16_accumulation", "_set_cublas_allow_fp16_accumulation")
    for kind in ("flash", "mem_efficient", "math", "cudnn"):
        add(f"sdp.{kind}_enabled", f"{kind}_sdp_enabled", f"enable_{kind}_sdp", cuda)
    add("sdp.fp16_bf16_reduction_math_allowed", "fp16_bf16_reduction_math_sdp_allowed",
        "allow_fp16_bf16_reduction_math_sdp", cuda)
    add("cudnn.enabled", "_get_cudnn_enabled", "_set_cudnn_enabled")
    add("cudnn.benchmark", "_get_cudnn_benchmark", "_set_cudnn_benchmark")
    add("cudnn.deterministic", "_get_cudnn_deterministic", "_set_cudnn_deterministic")
    add("mkldnn.enabled", "_get_mkldnn_enabled", "_set_mkldnn_enabled")
    table["deterministic_algorithms"] = (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
    )
    # fp32 precision (new API) last: the legacy setters above write it too ("highest" -> "ieee"), so it is set after them
    for backend, op in (("generic", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"), ("cuda", "all"),
                        ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"), ("mkldnn", "all")):
        try:
            C._get_fp32_precision_getter(backend, op)
        except (AttributeError, RuntimeError):
            continue
        table[f"fp32_precision.{backend}.{op}"] = (
            lambda b=backend, o=op: C._get_fp32_precision_getter(b, o),
            lambda v, b=backend, o=op: C._set_fp32_precision_setter(b, o, v),
        )
    table["default_dtype"] = (torch.get_default_dtype, torch.set_default_dtype)
    add("num_threads", "get_num_threads", "set_num_threads")  # the C setter: vLLM's CPU worker stubs the public one
    return table


_FLAGS = _flags()
_READ_ONLY = {"num_interop_threads": torch.get_num_interop_threads}  # settable once per process: recorded, not switched
_SNAPSHOT: dict[str, object] | None = None
_ORIGIN = ""


def capture() -> dict[str, object]:
    """The process's numerics state now. A switch torch refuses to read is left out: after a caller used torch's
    new fp32-precision API, reading the legacy TF32 flags raises, and the `fp32_precision.*` entries hold the same
    state anyway."""
    state = {}
    for name, (get, _) in _FLAGS.items():
        try:
            state[name] = get()
        except RuntimeError:
            continue
    state.update({name: get() for name, get in _READ_ONLY.items()})
    return state


def apply(state: dict[str, object]) -> None:
    """Make the process's numerics state `state`, touching only the switches that differ."""
    for name, (get, set_) in _FLAGS.items():
        if name in state and get() != state[name]:
            set_(state[name])
    left = {name: (get(), state[name]) for name, (get, _) in _FLAGS.items() if name in state and get() != state[name]}
    if left:
        raise StackError(f"torch refused to restore its numerics state ({left}); run the training stack in a fresh process")


def snapshot_before_engine() -> None:
    """Take the trainer's snapshot now, unless taken already. Called just before `import vllm` (engines/vllm/stack.py)."""
    global _SNAPSHOT, _ORIGIN
    if _SNAPSHOT is not None:
        return
    _SNAPSHOT = capture()
    _ORIGIN = ("taken after vllm was imported (by code outside divergence-probe): it may hold vLLM's settings"
               if "vllm" in sys.modules else "taken before vllm was imported")


def trainer_state() -> dict[str, object]:
    """The state a trainer process without vLLM has: the snapshot (taken now if nothing has taken it yet)."""
    snapshot_before_engine()
    return dict(_SNAPSHOT)


def origin() -> str:
    snapshot_before_engine()
    return _ORIGIN


def check_sdpa(backend: str, device: str, attn_implementation: str) -> None:
    """A user's --train-sdpa that cannot take effect is an error, not a silent no-op."""
    if backend not in SDPA_BACKENDS:
        raise StackError(f"--train-sdpa {backend!r} is not an SDPA backend; choose one of: {', '.join(SDPA_BACKENDS)}")
    if backend != "auto" and attn_implementation != "sdpa":
        raise StackError(f"--train-sdpa {backend} needs --train-attn sdpa (got {attn_implementation}); "
                         "drop --train-sdpa or use --train-attn sdpa")
    if device == "cpu" and backend not in _CPU_SDPA:
        raise StackError(f"--train-sdpa {backend} has no CPU kernel in torch; on the CPU choose one of: {', '.join(_CPU_SDPA)}")


@contextmanager
def trainer_numerics(sdpa: str = "auto", isolated: bool = True) -> Iterator[None]:
    """Run the block under the trainer's snapshot (and only the `sdpa` backend unless "auto"); the state found on
    entry (the engine's) is back on exit, even on error. `isolated=False` keeps the state the process has (what
    vLLM left behind): the setting that measures what isolation changes."""
    engine = capture()
    try:
        if isolated:
            apply(trainer_state())
        with ExitStack() as stack:
            if sdpa != "auto":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                stack.enter_context(sdpa_kernel(getattr(SDPBackend, _SDPA_ENUM[sdpa])))
            yield
    finally:
        apply(engine)


class SdpaChoice(torch.overrides.TorchFunctionMode):
    """Records which kernel torch's SDPA dispatcher picks for each attention call (`torch._fused_sdp_choice` on the
    call's own arguments: the same function `scaled_dot_product_attention` dispatches through), without changing it."""

    def __init__(self) -> None:
        super().__init__()
        self.chosen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.chosen.add(sdpa_choice(*args, **kwargs))
        return func(*args, **kwargs)


def sdpa_choice(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> str:
    from torch.nn.attention import SDPBackend

    try:
        index = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                        enable_gqa=enable_gqa)
    except RuntimeError as e:  # no backend enabled fits: the call itself is about to raise the same
        return f"none ({str(e).splitlines()[0]})"
    return SDPBackend(index).name.lower()


def describe(state: dict[str, object]) -> dict[str, object]:
    """The state as JSON-friendly values for the manifest."""
    return {name: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else list(v) if isinstance(v, tuple) else v)
            for name, v in state.items()}
