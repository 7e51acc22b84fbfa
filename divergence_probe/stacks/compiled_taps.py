"""Layer taps inside a compiled vLLM engine: the `dp::tap` op and the hooks that call it from within the graph.

An effectful custom op `dp::tap`, called from forward hooks installed on the model before torch.compile traces it, so
Dynamo inlines the hooks and Inductor emits the op as an extern call. Why this shape (docs/design/taps_under_compile.md has the measurements):
- Module hooks registered after the compile never fire: the compiled graph runs instead of the modules. Hooks present
  when Dynamo first traces the model are inlined into the one graph like any other Python, so they go in while
  `vllm.LLM(...)` builds the model (`building`), before its warm-up run compiles it.
- The op returns nothing, so without an effect Dynamo/Inductor drop it as dead code; registered as ORDERED-effectful
  it stays, in order, and its Python impl runs on every forward. Its arguments are the graph's own buffers, so a
  tap is what the graph computed, not a re-computation.
- A tap can only be neutral if the untapped graph materialises that tensor anyway: extern-kernel inputs and outputs
  (the projections' matmuls, attention, the embedding). Inductor keeps the residual stream in FP32 inside its
  fusions and never writes the BF16 `resid_mid`/`resid_out`; `q_norm`/`k_norm` are fused into RoPE. Tapping those
  forces a BF16 buffer that later kernels then read: the engine's numbers change. They are not captured (`REFUSED`).
- The impl clones: Inductor reuses a dead buffer for a later kernel's output within the same forward.
- Calls outside a capture (vLLM's warm-up and profile runs, untapped scoring) are ignored: nothing is active.
- CUDA graphs replay recorded kernels only; the Python impl does not run on replay, so taps need cudagraph_mode NONE
  (`check_cudagraphs`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch

from ..errors import StackError
from ..taps import ALL_TAPS, TapKey
from .hooks import arg, first_tensor

# Taps the compiled graph materialises whatever we do (checked per model in tests/test_compiled_taps.py: the
# logprobs of an engine with these tap points equal those of one without, bitwise); final_norm and logits come from
# outside the graph, as in an untapped compiled engine.
NEUTRAL = ("embed", "input_norm", "q_proj", "k_proj", "v_proj", "q_rope", "k_rope", "attn_core", "attn_out",
           "post_norm", "gate_proj", "up_proj", "swiglu", "mlp_out")
OUTSIDE = ("final_norm", "logits")
_FP32_STREAM = ("not captured under --engine compiled: Inductor keeps the residual stream in FP32 inside its fused "
                "add+norm kernels and never writes this BF16 tensor; tapping it would force one and change the "
                "engine's numerics (the FP32 stream is embed + the attn_out and mlp_out taps); use --engine eager")
REFUSED = {
    "resid_mid": _FP32_STREAM,
    "resid_out": _FP32_STREAM,
    "q_norm": "not captured under --engine compiled: Inductor fuses the per-head RMSNorm into RoPE and never writes "
              "its output; tapping it would force one and change the engine's numerics; use --engine eager",
    "k_norm": "not captured under --engine compiled: Inductor fuses the per-head RMSNorm into RoPE and never writes "
              "its output; tapping it would force one and change the engine's numerics; use --engine eager",
}
NO_TAP_POINTS = ("not captured: this compiled engine was built without tap points (an untapped engine is vLLM exactly "
                 "as deployed); ask for the taps when loading: divergence_probe.load(..., taps='all') (the CLI does)")
CUDA_GRAPHS = ("not captured: CUDA graphs replay without running the tap op; add --engine-args "
               "'{\"compilation_config\": {\"cudagraph_mode\": \"NONE\"}}' or use --engine eager")

_KEYS: list[TapKey] = []  # the op's int argument indexes this list (a Python int is a constant in the graph)
_ACTIVE: Callable[[TapKey, torch.Tensor], None] | None = None  # set during one scoring or sampling call
_LIB: torch.library.Library | None = None


class FusedSplit:
    """How one of vLLM's fused GEMM outputs splits into canonical taps, along the features, in the order of the
    model's packed_modules_mapping (qkv_proj = q, k, v; gate_up_proj = gate, up)."""

    def __init__(self, names: tuple[str, ...], sizes: list[int] | None = None) -> None:
        self.names, self.sizes = names, sizes

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        sizes = self.sizes or [x.shape[-1] // len(self.names)] * len(self.names)
        return dict(zip(self.names, x.split(sizes, dim=-1)))


def fused_projections(attn, mlp) -> list[tuple[torch.nn.Module, FusedSplit]]:
    """A decoder layer's fused projections and how each output splits into the q/k/v and gate/up taps."""
    return [(attn.qkv_proj, FusedSplit(("q_proj", "k_proj", "v_proj"), [attn.q_size, attn.kv_size, attn.kv_size])),
            (mlp.gate_up_proj, FusedSplit(("gate_proj", "up_proj")))]


def wants_tap_points(taps: frozenset[str]) -> bool:
    """Whether a compiled engine must be built with tap points for these taps."""
    return bool(taps & set(NEUTRAL))


def _key(name: str, layer: int) -> int:
    key = TapKey.of(name, layer)
    if key not in _KEYS:
        _KEYS.append(key)
    return _KEYS.index(key)


def _impl(x: torch.Tensor, key: int) -> None:
    active = _ACTIVE
    if active is not None:
        active(_KEYS[key], x.detach().clone())


def mark_effectful(qualname: str, lib: torch.library.Library) -> None:
    """Register `qualname` as an ORDERED side effect, so compile keeps it, in order, though it returns nothing.
    torch 2.13 has no public API for this (torch.library.custom_op's `register_effect` takes a private EffectType):
    this is the one place that uses the private one; tests/test_compiled_taps.py pins its behaviour."""
    from torch._library.effects import EffectType

    torch.library._register_effectful_op(qualname, EffectType.ORDERED, lib=lib)


def register_op() -> None:
    """Define `dp::tap(Tensor x, int key) -> ()` once per process: one impl for every device (CPU and CUDA), a fake
    impl for tracing, and the effect."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("dp", "DEF")
    lib.define("tap(Tensor x, int key) -> ()")
    lib.impl("tap", _impl, "CompositeExplicitAutograd")
    torch.library.register_fake("dp::tap", lambda x, key: None, lib=lib)
    mark_effectful("dp::tap", lib)
    _LIB = lib


def install(model: torch.nn.Module) -> None:
    """Forward hooks on the decoder's modules (the seams of stacks/vllm.py's eager taps) that call the op for every
    tap in NEUTRAL. Installed on the freshly built model, before its first forward compiles it."""
    register_op()
    tap = torch.ops.dp.tap
    inner = model.model

    def out(name: str, layer: int):
        key = _key(name, layer)
        return lambda m, a, k, o: tap(first_tensor(o), key)

    def inp(name: str, layer: int, index: int, arg_name: str):
        key = _key(name, layer)
        return lambda m, a, k: tap(arg(a, k, index, arg_name), key)

    inner.embed_tokens.register_forward_hook(out("embed", -1), with_kwargs=True)
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        layer.input_layernorm.register_forward_hook(out("input_norm", i), with_kwargs=True)
        attn.attn.register_forward_pre_hook(inp("q_rope", i, 0, "query"), with_kwargs=True)
        attn.attn.register_forward_pre_hook(inp("k_rope", i, 1, "key"), with_kwargs=True)
        attn.attn.register_forward_hook(out("attn_core", i), with_kwargs=True)
        attn.o_proj.register_forward_hook(out("attn_out", i), with_kwargs=True)
        layer.post_attention_layernorm.register_forward_hook(out("post_norm", i), with_kwargs=True)
        mlp.down_proj.register_forward_pre_hook(inp("swiglu", i, 0, "input_"), with_kwargs=True)
        mlp.down_proj.register_forward_hook(out("mlp_out", i), with_kwargs=True)
        for module, split in fused_projections(attn, mlp):
            keys = {name: _key(name, i) for name in split.names}

            def fused(m, a, k, o, keys=keys, split=split):
                for name, x in split(first_tensor(o)).items():
                    tap(x, keys[name])

            module.register_forward_hook(fused, with_kwargs=True)
    model._dp_tap_points = True


@contextlib.contextmanager
def building(model_classes: list[type]):
    """While vLLM builds its engine: every model of these classes gets its tap points as soon as it is constructed
    (vLLM compiles it at its first forward, still inside `LLM(...)`). The classes are restored afterwards."""
    originals = {cls: cls.__init__ for cls in model_classes}

    def wrap(cls, init):
        @functools.wraps(init)  # vLLM reads the constructor's signature to decide how to call it
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if type(self) is cls and not getattr(self, "_dp_tap_points", False):
                install(self)

        return __init__

    try:
        for cls, init in originals.items():
            cls.__init__ = wrap(cls, init)
        yield
    finally:
        for cls, init in originals.items():
            cls.__init__ = init


def router(on_tap: Callable[[TapKey, torch.Tensor], None], taps: frozenset[str]):
    """What `_ACTIVE` is set to for one scoring/sampling call (stacks/vllm.py sets it through its HookSet, which
    restores None after the call): the op's calls for the selected taps go to on_tap(key, fresh clone)."""
    selected = frozenset(taps)

    def route(key: TapKey, x: torch.Tensor) -> None:
        if key.name in selected:
            on_tap(key, x)

    return route


def status(taps_built: bool, cuda_graphs: bool) -> dict[str, str]:
    """Per canonical tap under --engine compiled: "captured", or why not."""
    result = {}
    for name in ALL_TAPS:
        if name in OUTSIDE:
            result[name] = "captured"
        elif name in REFUSED:
            result[name] = REFUSED[name]
        elif cuda_graphs:
            result[name] = CUDA_GRAPHS
        elif not taps_built:
            result[name] = NO_TAP_POINTS
        else:
            result[name] = "captured"
    return result


def requested_cudagraph_mode(engine_args: dict, device: str) -> str:
    """The cudagraph mode an engine with these args will run (before building it): the user's, else vLLM's default
    on this device (CPU: none; CUDA with compilation: not NONE)."""
    config = engine_args.get("compilation_config")
    mode = config.get("cudagraph_mode") if isinstance(config, dict) else None
    if mode is not None:
        return str(getattr(mode, "name", mode)).upper()
    return "NONE" if device == "cpu" else "DEFAULT"


def tap_points_for(taps: str | None, settings) -> bool:
    """Whether a compiled engine for these settings is built with tap points for the `taps` a run will ask for.
    `all` takes what the engine can give: under CUDA graphs (which replay without the op) that is no tap points,
    and the status lists the layer taps with the reason; taps named one by one must be captured, so CUDA graphs
    are refused for them before anything loads."""
    from ..taps import parse_tap_selection

    if not wants_tap_points(parse_tap_selection(taps or "none")):
        return False
    replays = settings.device != "cpu" and requested_cudagraph_mode(settings.engine_kwargs(), settings.device) != "NONE"
    if replays and settings.engine == "compiled" and (taps or "").strip() != "all":
        check_cudagraphs(settings.engine_kwargs(), settings.device)
    return not replays


def check_cudagraphs(engine_args: dict, device: str) -> None:
    """Refuse layer taps, before any engine starts, where CUDA graphs would replay the graph without the tap op."""
    mode = requested_cudagraph_mode(engine_args, device)
    if device != "cpu" and mode != "NONE":
        raise StackError(f"layer taps under --engine compiled need CUDA graphs off (cudagraph_mode {mode}): graph "
                         "replay skips the tap op; add --engine-args '{\"compilation_config\": {\"cudagraph_mode\": "
                         "\"NONE\"}}' or use --engine eager")
