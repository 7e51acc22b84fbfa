"""Grafting on transformers: its own ops run on another stack's captured tensors, one op (or one layer tail) at a time.

    ops = HFReplay(model)
    outputs = ops.replay(taps)              # {TapKey: what this stack's op makes of the other stack's inputs}
    logits = ops.forward_from(l, hidden)    # the rest of the forward from layer l's input residual stream

Every op is the model's own module or function, looked up when it runs, so a region patch (align.apply, a
HookSet replacement) is what runs: the aligned RoPE through the modeling file's `apply_rotary_pos_emb`, aligned
SwiGLU through the MLP's replaced forward, aligned RMSNorm through the replaced decoder-layer forward. Tensors go
in with the batch dimension the forward gives them (`[1, T, ...]`), so a GEMM sees the same shapes as in the
forward: with the forward's own inputs, every replayed output is bitwise the forward's tap.

Where the residual add and the norm after it are one op on the other stack (vLLM's fused add+RMSNorm normalises
the FP32 sum of `x` and `residual`), the seam is the add and the norm together: `post_norm` is replayed from
(`resid_in`, `attn_out`), the next `input_norm` and `final_norm` from (`resid_mid`, `mlp_out`), by running the
decoder layer's own forward with its attention and MLP stubbed to return the other stack's outputs. So the
norm sees whatever this stack's residual add gives it (BF16 sum as shipped, FP32 sum when rmsnorm is aligned),
and `resid_out` is this stack's add of the other stack's `mlp_out` to the `resid_mid` it formed itself from the
other stack's inputs (which equals the other stack's `resid_mid` whenever that add agrees: its own seam).

A mixture-of-experts block is replayed on the other stack's routes (`expert_ids`, `expert_weights` among `taps`):
runs/graft.py says why.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator, Mapping

import torch

from ...models import find
from ..layouts import layout_of
from ...taps import TapKey


class _Stub(torch.nn.Module):
    """A child module stand-in for one replay: returns `fn(*args)` (and records what it was given)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


@contextmanager
def _children(root: torch.nn.Module, stubs: Mapping[str, torch.nn.Module]) -> Iterator[None]:
    """Swap the modules at these dotted paths from `root` for the block (a parent's forward finds its children by
    attribute, at call time)."""
    slots = [(find(root, path.rpartition(".")[0]), path.rpartition(".")[2], stub) for path, stub in stubs.items()]
    saved = [(parent, name, parent._modules[name]) for parent, name, _ in slots]
    try:
        for parent, name, stub in slots:
            parent._modules[name] = stub
        yield
    finally:
        for parent, name, module in saved:
            parent._modules[name] = module


class HFReplay:
    def __init__(self, model) -> None:
        self.model = model
        self.layout = layout_of(model, "hf")
        self.layers = find(model, self.layout.model["layers"])
        self.config = model.config

    def _role(self, name: str):
        """A model-level module by role (engines/hf/layouts.py), looked up now: a region patch may have replaced its forward."""
        return find(self.model, self.layout.model[name])

    # ------------------------------------------------------------------------------------------ forward context
    def _context(self, embeds: torch.Tensor):
        """What the model's forward computes once per call and hands every layer: masks, positions, RoPE cos/sin
        (transformers' Qwen2Model/Qwen3Model.forward, with use_cache=False and no padding)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        positions = torch.arange(embeds.shape[1], device=embeds.device)[None]
        kwargs = dict(config=self.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                      position_ids=positions)
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if any(self._mask_kind(i) == "sliding_attention" for i in range(len(self.layers))):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks, positions, self._role("rotary")(embeds, positions)

    def _mask_kind(self, i: int) -> str:
        """The mask layer i attends with: Qwen2/Qwen3 name one per layer (`layer_types`); Qwen3-MoE's model gives
        every layer the same one, a sliding-window mask where `sliding_window` is set (Qwen3MoeModel.forward)."""
        kinds = getattr(self.config, "layer_types", None)
        if kinds is not None:
            return kinds[i]
        return "full_attention" if getattr(self.config, "sliding_window", None) is None else "sliding_attention"

    def _layer(self, i: int, hidden: torch.Tensor, masks, positions, rope) -> torch.Tensor:
        return self.layers[i](hidden, attention_mask=masks[self._mask_kind(i)], position_embeddings=rope,
                              position_ids=positions, past_key_values=None, use_cache=False)

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[1, T, D] final-norm output -> [T, V] logits of every row (the caller keeps the scored ones: all but the
        last of a prompt, all of a sampled sequence's fed rows)."""
        return self._role("lm_head")(normed)[0]

    # ------------------------------------------------------------------------------------------ depth
    def forward_from(self, start: int, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, D] residual stream entering layer `start` (start = L: entering the final norm) -> [T, V] logits
        of this stack's forward from there on. `embeds` ([T, D], any stack's) sets the dtype/device of RoPE."""
        masks, positions, rope = self._context(embeds[None])
        h = hidden[None]
        for i in range(start, len(self.layers)):
            h = self._layer(i, h, masks, positions, rope)
        return self._logits(self._role("final_norm")(h))

    def lm_head(self, final_norm: torch.Tensor) -> torch.Tensor:
        """[T, D] final-norm output -> [T, V]: the lm_head alone."""
        return self._logits(final_norm[None])

    # ------------------------------------------------------------------------------------------ local
    def replay(self, taps: Mapping[TapKey, torch.Tensor]) -> dict[TapKey, torch.Tensor]:
        """taps: one sequence's tensors from the other stack, `[T, features]` by TapKey (every tap of the run).
        Returns, per seam, this stack's op applied to the other stack's inputs of that seam, `[T, features]`."""
        n = len(self.layers)

        def t(name: str, i: int) -> torch.Tensor:  # [T, F] -> [1, T, F]: the forward's layout
            return taps[TapKey.of(name, i)][None]

        embed = t("embed", -1)
        T = embed.shape[1]
        masks, positions, rope = self._context(embed)
        cos, sin = rope
        out: dict[TapKey, torch.Tensor] = {}

        def put(name: str, i: int, x: torch.Tensor) -> None:
            out[TapKey.of(name, i)] = x.reshape(T, -1)

        roles = self.layout.layer
        norm_input = embed  # what the next input norm sees: the residual add's output, as this stack makes it
        for i, layer in enumerate(self.layers):
            def m(role: str, layer=layer):  # a module of this layer by role (models/), looked up now
                return find(layer, roles[role])

            attn, mlp = m("attn"), m("mlp")
            d = attn.head_dim
            put("input_norm", i, m("input_norm")(norm_input))
            x = t("input_norm", i)
            for name in ("q_proj", "k_proj", "v_proj"):
                put(name, i, m(name)(x))
            q, k = t("q_proj", i).view(1, T, -1, d), t("k_proj", i).view(1, T, -1, d)
            if "q_norm" in roles:  # Qwen3
                put("q_norm", i, m("q_norm")(q))
                put("k_norm", i, m("k_norm")(k))
                q, k = t("q_norm", i).view(1, T, -1, d), t("k_norm", i).view(1, T, -1, d)
            apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb  # a region patch replaces it there
            q_rope, k_rope = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            put("q_rope", i, q_rope.transpose(1, 2))
            put("k_rope", i, k_rope.transpose(1, 2))
            put("attn_core", i, self._attention(attn, i, *(t(n, i).view(1, T, -1, d).transpose(1, 2)
                                                           for n in ("q_rope", "k_rope", "v_proj")), masks))
            put("attn_out", i, m("o_proj")(t("attn_core", i)))

            # the residual adds and post norm through the layer's own forward (module docstring)
            seen = {}

            def post_norm(h, _norm=m("post_norm")):
                seen["resid_mid"] = h
                seen["post_norm"] = _norm(h)
                return seen["post_norm"]

            resid_in = embed if i == 0 else t("resid_out", i - 1)
            stubs = {roles["input_norm"]: _Stub(lambda h: h),
                     roles["attn"]: _Stub(lambda *a, _x=t("attn_out", i), **k: (_x, None)),
                     roles["post_norm"]: _Stub(post_norm),
                     roles["mlp"]: _Stub(lambda h, _x=t("mlp_out", i): _x)}
            with _children(layer, stubs):
                norm_input = self._layer(i, resid_in, masks, positions, rope)
            put("resid_mid", i, seen["resid_mid"])
            put("post_norm", i, seen["post_norm"])
            put("resid_out", i, norm_input)

            x = t("post_norm", i)
            if "gate" in roles:  # a mixture of experts
                self._moe(layer, i, x, t, put, out)
                continue
            put("gate_proj", i, m("gate_proj")(x))
            put("up_proj", i, m("up_proj")(x))
            got = {}
            stubs = {roles["gate_proj"]: _Stub(lambda h, _x=t("gate_proj", i): _x),
                     roles["up_proj"]: _Stub(lambda h, _x=t("up_proj", i): _x),
                     roles["down_proj"]: _Stub(lambda h: got.setdefault("swiglu", h))}
            with _children(layer, stubs):  # the MLP's own forward: act_fn(gate) * up, or the aligned SwiGLU
                mlp(x)
            put("swiglu", i, got["swiglu"])
            put("mlp_out", i, m("down_proj")(t("swiglu", i)))
        put("final_norm", n, self._role("final_norm")(norm_input))
        logits = TapKey.of("logits", n)  # the rows the other stack scored: a prompt's all but last, a sample's all
        out[logits] = self._logits(t("final_norm", n))[: taps[logits].shape[0]]
        return out

    def _moe(self, layer, i: int, x: torch.Tensor, t, put, out) -> None:
        """A mixture-of-experts layer's two seams (runs/graft.py says why two): the router on the other stack's
        `post_norm` (element 0 of its output, the logits), and the MoE block's own forward on that `post_norm` with
        its router stubbed to return the other stack's routes, so the experts run on exactly the other stack's
        experts, with its gate weights cast to the dtype this router hands its experts."""
        roles = self.layout.layer
        put("router_logits", i, find(layer, roles["gate"])(x)[0])
        logits = out[TapKey.of("router_logits", i)]
        ids, weights = t("expert_ids", i)[0], t("expert_weights", i)[0]
        routes = (logits, weights.to(logits.dtype), ids.to(device=logits.device, dtype=torch.long))
        with _children(layer, {roles["gate"]: _Stub(lambda h: routes)}):
            put("mlp_out", i, find(layer, roles["mlp"])(x))

    def _attention(self, attn, i: int, q, k, v, masks) -> torch.Tensor:
        """The attention function the layer calls (transformers' registry, looked up now), as Qwen attention calls
        it: [1, heads, T, d] query/key/value -> [1, T, heads, d]."""
        from importlib import import_module

        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        eager = import_module(type(attn).__module__).eager_attention_forward
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
        core, _ = interface(attn, q, k, v, masks[self._mask_kind(i)], dropout=0.0, scaling=attn.scaling,
                            sliding_window=attn.sliding_window)
        return core
