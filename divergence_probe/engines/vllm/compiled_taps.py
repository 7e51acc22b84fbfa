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
  (the projections' matmuls, attention). Inductor keeps the residual stream in FP32 inside its
  fusions and never writes the BF16 `resid_mid`/`resid_out`; `q_norm`/`k_norm` are fused into RoPE. Tapping those
  forces a BF16 buffer that later kernels then read: the engine's numbers change. They are not captured (`REFUSED`).
- One path for CPU and CUDA, with or without CUDA graphs: the impl only copies x into a static buffer of its tap
  (`buf[:rows].copy_(x)`), allocated once when the model is built, sized for the most rows a step can hold. A CUDA-graph
  capture runs the impl once and records that copy (fixed addresses, no allocation, no host sync); every replay
  repeats it, while the Python impl itself never runs on replay. Nothing else happens in the graph: the host reads
  the step's rows after each engine step's model call (`deliver`, outside any graph) and hands them over as views,
  valid until the next step writes the buffers again: a scoring call is one step, and the run loop reduces a batch's
  taps before it calls the engine again, on the same device stream (one thread, whose current stream in-process vLLM
  sets once; nothing here switches streams), so a compare copies each tap once, in the graph (x itself cannot be
  handed over: Inductor reuses its memory within the forward). The buffers of one width are rows of one tensor, so the
  host reads them as one, and a prompt's taps of that width are one view.
- A mixture-of-experts layer (Qwen3-MoE) has two more tap points: `router_logits` (the gate's output) and the route
  records `expert_ids`/`expert_weights` (what the router's `select_experts` returns, which the experts then run with;
  taps.ROUTE_RECORDS), with buffers of their own (ids int64, weights FP32: the copy widens whatever integer or float
  type the router returns, losslessly) handed over one by one, as the routing capture reads them (runs/route_capture.py;
  rl's rollouts: stack.py `routes_recorded`, after every decode step too).
  Where they run differs by platform, and the op covers both. On the CPU vLLM calls its MoE forward as plain Python
  (moe_runner.py `_select_forward`), so Dynamo traces the gate (a module: its hook is inlined) and select_experts (a
  method: wrapped on the router object before the trace, so the wrapper is inlined) into the one graph; their
  outputs are inputs of extern kernels (the gate GEMM's output feeds torch.topk, the ids and weights the fused-experts
  kernel), so the graph materialises them anyway (bitwise neutral on the CPU build, checked as for the other taps; on
  the H200 a tapped MoE engine was not: docs/design/moe.md). On CUDA the MoE forward
  is vLLM's opaque custom op `vllm.moe_forward`: the gate and select_experts run as eager Python inside it, hooks
  and wrapper included, on every call without a graph; a CUDA-graph capture (piecewise or full: the op is not a
  splitting op) records their `dp::tap` copies with the experts' kernels, and a replay repeats them, though no Python
  runs then. What would make a tap miss the routing the engine used is refused when the engine is built
  (`check_routes`): a gate fused with a shared-expert gate (the gate module never runs) or a monolithic experts
  kernel that routes inside itself (select_experts never runs); where router_logits are captured too (a compare
  with layer taps), the route records' fidelity check (route_capture.RouteRecordError: ids a top-k of the logits,
  every token and layer) catches any other stale buffer; a replay without them (--taps none --align routing)
  checks only that every row is k distinct experts (engines/hf/trainer.py), which a zeroed buffer is not.
- Only the taps the engine was asked for at load become tap points, each with its buffer (rows x features per tap per
  layer): every op call hands a tensor out of the graph, a constraint on Inductor's fusion, so an engine asked for
  fewer taps has fewer chances to compile differently from the untapped one. The selection is part of the engine's
  identity (engines/vllm/engine_start.py `_engine_key`).
- Steps outside a scoring or sampling call (vLLM's warm-up, profile and capture runs) write the buffers too and are
  never read: nothing is active then. Inside a call, a step run without a graph skips the taps the call does not read
  (`TapPoints.wanted`), so an engine built with every tap point and asked for a few copies only those; a graph replay
  copies
  every tap it was captured with.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable

import torch

from ...errors import StackError
from ...taps import ALL_TAPS, LAYER_TAPS, ROUTE_RECORDS, Tap, TapKey
from ...models import dims, family_of, find
from ..hooks import HookSet, after_call
from ..layouts import layout_of
from .seams import decoder_layers, model_seams

# Taps the compiled graph materialises whatever we do (checked per model in tests/engines/vllm/test_compiled_taps.py: the
# logprobs of an engine with these tap points equal those of one without, bitwise); final_norm and logits come from
# outside the graph, as in an untapped compiled engine.
NEUTRAL = ("input_norm", "q_proj", "k_proj", "v_proj", "q_rope", "k_rope", "attn_core", "attn_out",
           "post_norm", "gate_proj", "up_proj", "swiglu", "mlp_out")
# A mixture-of-experts layer's router, neutral as those on the CPU build (checked on the tiny Qwen3-MoE by the same
# test; on the H200 one token of 481 moved: docs/results/h200/moe/compiled/README.md): its logits
# and its choice (taps.ROUTE_RECORDS), handed over one tap at a time, not stacked with the taps of their width: the
# routing capture reads them per layer. The choice goes into buffers of ROUTE_DTYPES, wide enough for any router's.
ROUTER = ("router_logits", *ROUTE_RECORDS)
ROUTE_DTYPES = {"expert_ids": torch.int64, "expert_weights": torch.float32}
# Taken outside the graph: final_norm and logits as in an untapped compiled engine; embed is a lookup (no arithmetic),
# so the embedding rows of the step's input ids are the graph's values bit for bit, and a tap point there changed
# Inductor's fusion of the first add+norm on the CPU build (docs/results/tap_points/README.md).
OUTSIDE = ("embed", "final_norm", "logits")
EMBED = TapKey.of("embed", -1)
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
NOT_BUFFERED = ("not captured: this compiled engine was built with tap points for other taps only (they are "
                "built for the taps asked for at load); ask for this one when loading: "
                "divergence_probe.load(..., taps='all') (the CLI passes --taps)")

_OWNER: "TapPoints | None" = None  # the live compiled engine's tap points, which the op writes into (TapPoints.live)
_LIB: torch.library.Library | None = None  # the op's definition: once per process, as every torch op


def wants_tap_points(taps: frozenset[str]) -> bool:
    """Whether a compiled engine must be built with tap points for these taps."""
    return bool(taps & set(NEUTRAL + ROUTER))


def _impl(x: torch.Tensor, key: int) -> None:
    """The op: x's rows into the buffer of tap point `key` of the live engine's tap points (TapPoints.copy)."""
    owner = _OWNER
    if owner is None:
        raise StackError(f"the compiled engine called tap point {key} with no engine's tap points live (they are from "
                         "the engine's build on: TapPoints.live); report this as a bug")
    owner.copy(x, key)


def _capturing(x: torch.Tensor) -> bool:
    """Whether this op call is being recorded into a CUDA graph."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def mark_effectful(qualname: str, lib: torch.library.Library) -> None:
    """Register `qualname` as an ORDERED side effect, so compile keeps it, in order, though it returns nothing.
    torch 2.13 has no public API for this (torch.library.custom_op's `register_effect` takes a private EffectType):
    this is the one place that uses the private one; tests/engines/vllm/test_compiled_taps.py pins its behaviour."""
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


def features(model: torch.nn.Module) -> dict[str, int]:
    """Features per row of each tap in NEUTRAL and ROUTER that the model's family has (route records: the router's
    top-k), from its config (tensor parallelism is refused: one partition)."""
    family, sizes = family_of(model), dims(model.config)
    result = {name: sizes[family.widths[name]] for name in NEUTRAL + ROUTER[:1] if name in family.layer_taps}
    if family.top_k_field is not None:
        result |= {name: getattr(model.config, family.top_k_field) for name in ROUTE_RECORDS}
    return result


def step_rows(vllm_config) -> int:
    """The most rows one forward can hold: the scheduler's token budget, or a padded CUDA-graph capture size if one
    were larger (vLLM keeps them below it)."""
    comp = vllm_config.compilation_config
    sizes = list(getattr(comp, "cudagraph_capture_sizes", None) or [])
    largest = getattr(comp, "max_cudagraph_capture_size", 0) or 0
    return max([vllm_config.scheduler_config.max_num_batched_tokens, largest, *sizes])


class TapPoints:
    """The tap points of one compiled engine: the op keys its graph calls `dp::tap` with, their static buffers, and
    the scoring or sampling call that reads them now. Owned by the engine (engines/vllm/stack.py keeps it beside the
    engine, which lives as long as its process): the op writes into it while it is live, and what it changed (the
    op's owner, a router's wrapped select_experts) is in its HookSet, conflict-checked and undone on close."""

    def __init__(self) -> None:
        self.keys: list[TapKey] = []  # the op's int argument indexes this list (an int is a constant in the graph)
        self.buffers: dict[int, torch.Tensor] = {}  # op key -> static [most rows of a step, features]; fixed addresses
        # per width and dtype: (op keys, [taps, rows, features])
        self.groups: list[tuple[tuple[int, ...], torch.Tensor]] = []
        self.active: Callable[[torch.Tensor], None] | None = None  # set during one scoring or sampling call
        self.wanted: frozenset[int] = frozenset()  # set with `active`: the op keys that call reads
        self.built: frozenset[str] = frozenset()  # the taps the model got tap points for (empty: none, as deployed)
        self._hooks = HookSet()

    def live(self) -> "TapPoints":
        """The op writes into these tap points from now until close (one compiled engine per process)."""
        self._hooks.replace(sys.modules[__name__], "_OWNER", self, owner="the tap points of a compiled vLLM engine")
        return self

    def close(self) -> None:
        self._hooks.remove()

    def key(self, name: str, layer: int) -> int:
        key = TapKey.of(name, layer)
        if key not in self.keys:
            self.keys.append(key)
        return self.keys.index(key)

    def copy(self, x: torch.Tensor, key: int) -> None:
        """x's rows into its tap's static buffer, and nothing else: under CUDA-graph capture this copy is what gets
        recorded and replayed, so it must neither allocate nor sync nor depend on Python state that changes per step.
        Checks run in Python (at capture, or on every call without graphs); a buffer is never (re)allocated here.

        A step run without a graph inside a scoring or sampling call skips the taps that call does not read: nothing
        reads them before the next step writes them again. Everywhere else every tap is copied: vLLM captures its
        graphs while it builds the engine, outside any call, and a graph must record every tap point's copy to serve
        any later selection (`_capturing` makes sure of it should a capture ever happen inside a call)."""
        if self.active is not None and key not in self.wanted and not _capturing(x):
            return
        buf = self.buffers.get(key)
        if buf is None:  # install hooks only the taps it allocates for
            raise StackError(f"the compiled engine called tap {self.keys[key].label} for which no buffer was "
                             "allocated; buffers are made when the model is built (TapPoints.install): report this "
                             "as a bug")
        rows = x.shape[0]
        name = self.keys[key].name
        widens = name in ROUTE_DTYPES and torch.promote_types(x.dtype, buf.dtype) == buf.dtype  # a lossless copy
        if rows > buf.shape[0] or x.numel() != rows * buf.shape[1] or not (x.dtype == buf.dtype or widens) \
                or x.device != buf.device:
            raise StackError(f"tap {self.keys[key].label}: a step of {rows} rows of {tuple(x.shape[1:])} {x.dtype} "
                             f"on {x.device} does not fit its buffer {tuple(buf.shape)} {buf.dtype} on {buf.device} "
                             "(sized from max_num_batched_tokens and the CUDA-graph capture sizes); report this as a "
                             "bug")
        buf[:rows].view(x.shape).copy_(x)

    def install(self, model: torch.nn.Module, taps: frozenset[str], rows: int) -> None:
        """Forward hooks on the decoder's modules (seams.py: the eager taps' seams) that call the op for each tap
        of `taps` in NEUTRAL, and their static buffers of `rows` rows. Installed on the freshly built model, before
        its first forward compiles it (and before any CUDA-graph capture). Only the asked-for taps become tap points:
        each op call is a tensor the graph must hand out, so fewer calls leave Inductor fewer fusion decisions to
        change. A seam on a method (a MoE router's select_experts) is wrapped on its object through the HookSet; the
        module hooks stay for the model's life, as the graph traced with them does."""
        register_op()
        tap = torch.ops.dp.tap
        selected = frozenset(taps) & set(NEUTRAL + ROUTER)
        keys: list[int] = []  # every tap point made here: each gets its buffer
        for i, seams in enumerate(model_seams(model, selected)):
            for seam in seams:
                seam_keys = {name: self.key(name, i) for name in seam.names if name in selected}
                if not seam_keys:
                    continue
                keys.extend(seam_keys.values())

                def call(a, k, o, seam=seam, seam_keys=seam_keys):
                    parts = seam.read(a, k, o)
                    for name, key in seam_keys.items():
                        tap(parts[name], key)

                if seam.method is not None:
                    self._hooks.replace(seam.module, seam.method, after_call(getattr(seam.module, seam.method), call),
                                        owner="the tap points of a compiled vLLM engine")
                elif seam.before:
                    seam.module.register_forward_pre_hook(lambda m, a, k, call=call: call(a, k, None), with_kwargs=True)
                else:
                    seam.module.register_forward_hook(lambda m, a, k, o, call=call: call(a, k, o), with_kwargs=True)
        self.allocate(model, keys, rows)
        self.built = selected

    def allocate(self, model: torch.nn.Module, keys: list[int], rows: int) -> None:
        """The static buffers of the tap points `keys` (the op keys install made), `rows` rows each, in the model's
        dtype on its device (route records: ROUTE_DTYPES): made once, outside any forward, so a CUDA-graph capture
        finds fixed addresses."""
        weight = find(model, layout_of(model, "vllm").model["embed"]).weight
        if weight.device.type == "meta":
            raise StackError("tap buffers need the model's device, but vLLM built the model on the meta device; "
                             "build the engine without layer taps (--taps none) or use --engine eager")
        sizes = features(model)
        self.make_buffers({key: sizes[self.keys[key].name] for key in keys}, rows, weight.dtype, weight.device)

    def make_buffers(self, widths: dict[int, int], rows: int, dtype: torch.dtype, device) -> None:
        """One zeroed [taps, rows, features] tensor per width (`widths`: op key -> features); each tap's buffer is its
        row of that tensor. So the host reads a step's taps of one width as one tensor, one view per prompt, instead
        of one per tap (`router`). The taps in ROUTER get a tensor each, route records in their ROUTE_DTYPES."""
        self.buffers.clear()
        self.groups.clear()
        by_width: dict[tuple, list[int]] = {}
        for key, width in widths.items():
            name = self.keys[key].name
            by_width.setdefault((width, ROUTE_DTYPES.get(name, dtype), key if name in ROUTER else None), []).append(key)
        for (width, group_dtype, _), keys in by_width.items():
            group = torch.zeros(len(keys), rows, width, dtype=group_dtype, device=device)
            self.groups.append((tuple(keys), group))
            self.buffers.update({key: group[j] for j, key in enumerate(keys)})

    def buffer_bytes(self) -> int:
        """Device memory the tap buffers hold (the manifest records it)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @contextlib.contextmanager
    def building(self, model_classes: list[type], taps: frozenset[str]):
        """While vLLM builds its engine: the model of these classes gets its tap points, and buffers for `taps`, as
        soon as it is constructed (vLLM compiles it at its first forward and captures CUDA graphs later, still inside
        `LLM(...)`). The buffers' rows come from the vLLM config the model is built with. The classes' constructors
        are restored afterwards."""

        def wrap(cls, init):
            @functools.wraps(init)  # vLLM reads the constructor's signature to decide how to call it
            def __init__(model, *args, **kwargs):
                init(model, *args, **kwargs)
                if type(model) is cls and not self.built:  # the outermost class's constructor, once per engine
                    config = kwargs.get("vllm_config")
                    if config is None:
                        from vllm.config import get_current_vllm_config

                        config = get_current_vllm_config()
                    self.install(model, taps, step_rows(config))

            return __init__

        with HookSet() as constructors:
            for cls in model_classes:
                constructors.replace(cls, "__init__", wrap(cls, cls.__init__), owner="a compiled vLLM engine's build")
            yield

    def wanted_keys(self, taps: frozenset[str]) -> frozenset[int]:
        """The op keys of the tap points a call for these taps reads: what `wanted` is set to beside `active`."""
        return frozenset(key for key in self.buffers if self.keys[key].name in taps)

    def router(self, on_tap: Callable[[Tap, torch.Tensor], None], taps: frozenset[str], embedding: torch.nn.Module):
        """What `active` is set to for one scoring/sampling call (engines/vllm/stack.py sets it through its HookSet,
        which restores None after the call): after a step's model call, `deliver(input_ids)` hands on_tap the step's
        rows of the selected taps: the layer taps of one width stacked as [taps, rows, features] under a tuple of
        their keys, a view of the buffers that is valid until the next step writes them (a receiver that keeps it
        longer copies it: base.TapSink); the taps in ROUTER one by one, as [rows, features]; and `embed` as the
        embedding rows of the step's input ids (`embedding`: the model's embed_tokens)."""
        selected = frozenset(taps)
        reads = []  # (keys handed over, the width's buffer, which of its taps: None for all)
        for keys, group in self.groups:
            chosen = [j for j, key in enumerate(keys) if self.keys[key].name in selected]
            if chosen and self.keys[keys[0]].name in ROUTER:
                reads.append((self.keys[keys[0]], group[0], None))
            elif chosen:
                index = None if len(chosen) == len(keys) else torch.tensor(chosen, device=group.device)
                reads.append((tuple(self.keys[keys[j]] for j in chosen), group, index))

        def route(input_ids: torch.Tensor) -> None:
            rows = input_ids.shape[0]
            if "embed" in selected:
                on_tap(EMBED, torch.nn.functional.embedding(input_ids, embedding.weight))
            for keys, group, index in reads:
                if rows > group.shape[-2]:
                    label = keys.label if isinstance(keys, TapKey) else keys[0].label
                    raise StackError(f"a step of {rows} rows is larger than the tap buffers of {label} .. "
                                     f"({group.shape[-2]} rows); report this as a bug")
                if isinstance(keys, TapKey):
                    on_tap(keys, group[:rows])
                    continue
                step = group[:, :rows]
                on_tap(keys, step if index is None else step.index_select(0, index))

        return route

    def deliver(self, input_ids: torch.Tensor) -> None:
        """After one engine step's model call, outside any graph: hand the rows of its input ids of every selected
        tap to the active call (none outside a scoring/sampling call). Reads are queued on the device stream after
        the step's kernels (or its graph replay), so no sync is needed."""
        active = self.active
        if active is not None:
            active(input_ids)


def declared() -> dict[str, str]:
    """Per canonical tap, before a compiled engine is built: "captured" (once built with tap points for it, or taken
    outside the graph), or why never (REFUSED)."""
    return {name: REFUSED.get(name, "captured") for name in ALL_TAPS}


def status(taps_built: frozenset[str], family=None) -> dict[str, str]:
    """Per canonical tap under --engine compiled: "captured", or why not. `taps_built`: the taps the engine has tap
    buffers for (empty: built without tap points). `family`: the model's (models/), whose layers lack some taps (a
    dense one has no router, a sparse one no swiglu): those are left out, and a mixture of experts' route records
    come in."""
    result = {}
    names = list(ALL_TAPS) if family is None else [n for n in ALL_TAPS if n not in LAYER_TAPS or n in family.layer_taps]
    for name in names + list(ROUTE_RECORDS if family is not None and family.top_k_field else ()):
        if name in OUTSIDE:
            result[name] = "captured"
        elif name in REFUSED:
            result[name] = REFUSED[name]
        elif not taps_built:
            result[name] = NO_TAP_POINTS
        elif name not in taps_built:
            result[name] = NOT_BUFFERED
        else:
            result[name] = "captured"
    return result


def tap_points_for(taps: str | None, settings, family=None, routes: bool = False) -> frozenset[str]:
    """The layer taps a compiled engine for these settings gets tap buffers for, given the `taps` the runs will ask
    for (empty: no tap points, vLLM as deployed) and the model's family (None: a dense one). A mixture of experts gets
    its route records with its router logits (a compare checks one against the other), or alone where `routes` (a
    run replays them: --align routing). CUDA graphs replay the buffers' copies, so every cudagraph mode is fine."""
    from ...tap_selection import parse_tap_selection

    if settings.engine != "compiled":
        return frozenset()  # eager taps are plain module hooks: no tap points, no buffers
    asked = frozenset(parse_tap_selection(taps or "none"))
    if family is None or family.top_k_field is None:
        return asked & set(NEUTRAL)
    selected = asked & set(NEUTRAL + ROUTER[:1]) & set(family.layer_taps)
    return selected | set(ROUTE_RECORDS) if "router_logits" in selected or routes else selected


def check_routes(model: torch.nn.Module) -> None:
    """Refuse a compiled engine whose router tap points would not see the routing it runs: every MoE layer's gate must
    run as its own module (not fused with a shared-expert gate) and its router's select_experts must pick the experts
    (not a monolithic kernel that routes inside itself). Called once the engine is built: vLLM picks the kernel while
    it loads the weights."""
    layout = layout_of(model, "vllm")
    for i, layer in enumerate(decoder_layers(model)):
        runner = find(layer, layout.layer["experts"])
        if getattr(runner, "_fse_fuse_gate", False):
            raise StackError(f"layer {i}: vLLM fuses the router's gate with the shared-expert gate, so the router "
                             "logits never leave a module a tap point can read; use --engine eager")
        if getattr(runner, "is_monolithic", False):
            raise StackError(f"layer {i}: vLLM's experts kernel ({type(runner._quant_method).__name__}) routes inside "
                             "itself, so the routes it runs with never leave the kernel; use --engine eager")
