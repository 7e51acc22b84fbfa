"""A dense Qwen2/Qwen3 decoder written in plain torch, read straight from the checkpoint's safetensors: the engine's
own kernels, each rounding where this engine chose to round.

    logits = Model.load(path, config, dtype, device)(ids, lengths, emit)    # ids [B, T] right-padded to `lengths`;
                                                                            # emit(row, TapKey, [tokens, F])

Where it rounds, as shipped (R: a rounding to the run's dtype):
    RMSNorm       the input normalised in FP32, rounded, then times the weight in the run's dtype (2 R)
    RoPE          cos/sin and the rotation in FP32, rounded once (transformers rotates in the run's dtype)
    attention     torch SDPA over the whole padded batch, with an explicit mask
    SwiGLU        silu(gate) rounded, times up rounded (2 R); `act` is the seam the swiglu region replaces
    residual adds in the run's dtype
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from divergence_probe.taps import TapKey

Emit = Callable[[int, TapKey, torch.Tensor], None]  # (batch row, tap, [tokens, features])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    s = x.float()
    return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class Norm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(weight, requires_grad=False), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Layer(torch.nn.Module):
    """One decoder layer; its weights by their checkpoint names under the layer's prefix."""

    def __init__(self, w: Callable[[str], torch.Tensor | None], config: dict) -> None:
        super().__init__()
        eps = config["rms_norm_eps"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.heads
        self.input_norm, self.post_norm = Norm(w("input_layernorm.weight"), eps), Norm(w("post_attention_layernorm.weight"), eps)
        q_norm, k_norm = w("self_attn.q_norm.weight"), w("self_attn.k_norm.weight")  # Qwen3; Qwen2 has none
        self.q_norm = Norm(q_norm, eps) if q_norm is not None else None
        self.k_norm = Norm(k_norm, eps) if k_norm is not None else None
        self.proj = torch.nn.ParameterDict({
            name: torch.nn.Parameter(w(f"{part}.{name}.weight"), requires_grad=False)
            for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                ("mlp", ("gate_proj", "up_proj", "down_proj"))) for name in names})
        self.bias = torch.nn.ParameterDict({  # Qwen2's q/k/v biases
            name: torch.nn.Parameter(b, requires_grad=False) for name in ("q_proj", "k_proj", "v_proj")
            if (b := w(f"self_attn.{name}.bias")) is not None})
        self.act = silu_times  # the swiglu region's seam

    def forward(self, h, cos, sin, mask, emit) -> torch.Tensor:
        B, T, _ = h.shape
        x = self.input_norm(h)
        emit("input_norm", x)
        qkv = {}
        for name, heads in (("q", self.heads), ("k", self.kv_heads), ("v", self.kv_heads)):
            y = F.linear(x, self.proj[f"{name}_proj"], self.bias.get(f"{name}_proj"))
            emit(f"{name}_proj", y)
            qkv[name] = y.view(B, T, heads, self.head_dim)
        for name, norm in (("q", self.q_norm), ("k", self.k_norm)):
            if norm is not None:
                qkv[name] = norm(qkv[name])
                emit(f"{name}_norm", qkv[name].flatten(2))
            qkv[name] = rotate(qkv[name], cos, sin)
            emit(f"{name}_rope", qkv[name].flatten(2))
        q, k, v = (qkv[n].transpose(1, 2) for n in "qkv")  # [B, heads, T, d]
        core = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2).flatten(2)
        emit("attn_core", core)
        out = F.linear(core, self.proj["o_proj"])
        emit("attn_out", out)
        h = h + out
        emit("resid_mid", h)
        x = self.post_norm(h)
        emit("post_norm", x)
        gate, up = F.linear(x, self.proj["gate_proj"]), F.linear(x, self.proj["up_proj"])
        emit("gate_proj", gate)
        emit("up_proj", up)
        act = self.act(gate, up)
        emit("swiglu", act)
        out = F.linear(act, self.proj["down_proj"])
        emit("mlp_out", out)
        h = h + out
        emit("resid_out", h)
        return h


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[B, T, heads, d] rotated by [B, T, 1, d] cos/sin, in FP32, rounded once."""
    s = x.float()
    half = s.shape[-1] // 2
    turned = torch.cat((-s[..., half:], s[..., :half]), dim=-1)
    return (s * cos + turned * sin).to(x.dtype)


class Model(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor], config: dict, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.embed = torch.nn.Parameter(tensors["model.embed_tokens.weight"].to(dtype), requires_grad=False)
        self.layers = torch.nn.ModuleList(
            Layer(lambda name, i=i: _tensor(tensors, f"model.layers.{i}.{name}", dtype), config)
            for i in range(config["num_hidden_layers"]))
        self.norm = Norm(tensors["model.norm.weight"].to(dtype), config["rms_norm_eps"])
        head = tensors.get("lm_head.weight") if not config.get("tie_word_embeddings") else None
        self.head = self.embed if head is None else torch.nn.Parameter(head.to(dtype), requires_grad=False)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        theta = (config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta", 10000.0)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)

    @classmethod
    def load(cls, path: str, config: dict, dtype: torch.dtype, device: str) -> "Model":
        from safetensors.torch import load_file

        tensors = {}
        for shard in sorted(Path(path).glob("*.safetensors")):
            tensors.update(load_file(str(shard)))
        return cls(tensors, config, dtype).to(device).eval()

    def forward(self, ids: torch.Tensor, lengths: list[int], emit: Emit | None = None) -> torch.Tensor:
        """Logits [B, T, V] of right-padded rows of `lengths` tokens; `emit` gets each row's taps, padding cut."""
        B, T = ids.shape

        def tap(name: str, layer: int, x: torch.Tensor) -> None:
            if emit is not None:
                for row, n in enumerate(lengths):
                    emit(row, TapKey.of(name, layer), x[row, :n])

        positions = torch.arange(T, device=ids.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq.to(ids.device))
        cos, sin = (f(torch.cat((angles, angles), dim=-1))[None, :, None, :] for f in (torch.cos, torch.sin))
        keys = torch.arange(T, device=ids.device)[None, :] < torch.tensor(lengths, device=ids.device)[:, None]
        mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()[None, None] & keys[:, None, None, :]
        h = self.embed[ids]
        tap("embed", -1, h)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, lambda name, x, i=i: tap(name, i, x))
        h = self.norm(h)
        tap("final_norm", len(self.layers), h)
        logits = F.linear(h, self.head)
        if emit is not None:  # scored rows only: the last position predicts a token that is not in the prompt
            for row, n in enumerate(lengths):
                emit(row, TapKey.of("logits", len(self.layers)), logits[row, : n - 1])
        return logits


def _tensor(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor | None:
    return tensors[name].to(dtype) if name in tensors else None
