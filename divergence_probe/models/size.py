"""A model's sizes, from its config.json and the safetensors headers (no tensor is read): its parameters, the features
of every tap per token and its KV cache per token; and the memory of the device it would load on. Engine-neutral: what
an engine keeps of them (its KV blocks, its start-up profile) is its class's load plan (engines/protocol.py LoadPlan),
and what a run holds is the memory plan's (runs/memory.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

from ..errors import DeviceMemoryError

ENV = "DIVERGENCE_PROBE_DEVICE_MEMORY"
GiB = 1 << 30
MAX_DEVICE_BYTES = 1 << 60  # an override above any device's memory is a typo
CPU_RUNTIME = 1 * GiB  # the libraries a process imports and starts (its RSS before a tensor is counted)


@dataclass(frozen=True)
class ModelSize:
    """The sizes the plan needs, from config.json; `parameters` from the safetensors headers (one count, however
    the checkpoint stores them: both stacks load them in the run's dtype)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool
    parameters: int
    # the family's decoder-layer taps and their features per token (models/: Family.layer_taps, widths)
    layer_tap_widths: tuple[tuple[str, int], ...] = ()
    experts: int = 0  # a mixture of experts: experts per layer (0: a dense MLP)
    expert_intermediate: int = 0  # one expert's intermediate size

    @classmethod
    def of(cls, config: dict, family, tensors: dict | None = None) -> "ModelSize":
        """`family`: the model's (models.get_family of its model_type), given by the caller, who has it, so that sizing
        a model needs no family registry. `tensors`: checkpoint.checkpoint_tensors(folder) (name -> Tensor with a
        shape); None: counted from the config (a shape without files, for the benchmark's larger shapes). The taps and
        the MLP's width come from the family: a mixture of experts' per-token MLP is its top-k experts (`intermediate`
        = top_k x one expert's width), its router_logits tap one feature per expert."""
        from types import SimpleNamespace

        from .base import dims

        sizes = dims(SimpleNamespace(**config))
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        experts = sizes.get("experts", 0) if family.top_k_field else 0
        expert_width = int(config["moe_intermediate_size"]) if experts else 0
        intermediate = int(config[family.top_k_field]) * expert_width if experts else int(config["intermediate_size"])
        size = cls(hidden=hidden, intermediate=intermediate,
                   layers=int(config["num_hidden_layers"]), heads=heads,
                   kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
                   vocab=int(config["vocab_size"]), qk_norm="q_norm" in family.layer_taps, parameters=0,
                   layer_tap_widths=tuple((t, sizes[family.widths[t]]) for t in family.layer_taps),
                   experts=experts, expert_intermediate=expert_width)
        if tensors is None:
            count = size.parameters_from_config(bool(config.get("tie_word_embeddings")),
                                                config.get("model_type") == "qwen2")
        else:
            count = 0
            for tensor in tensors.values():
                n = 1
                for d in tensor.shape:
                    n *= d
                count += n
        return cls(**{**asdict(size), "parameters": count})

    def parameters_from_config(self, tied: bool, qkv_bias: bool) -> int:
        q, kv, h = self.q_width, self.kv_width, self.hidden
        mlp = (self.experts * 3 * h * self.expert_intermediate + self.experts * h) if self.experts else \
            3 * h * self.intermediate  # experts' gate/up/down and the router, or one dense MLP
        layer = h * (q + 2 * kv) + q * h + mlp + 2 * h
        layer += (q + 2 * kv) if qkv_bias else 0
        layer += 2 * self.head_dim if self.qk_norm else 0
        return self.layers * layer + self.vocab * h * (1 if tied else 2) + h

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def tap_widths(self) -> dict[str, tuple[int, int]]:
        """Per canonical tap: (features per token, how many of it a forward makes); `logits` is counted apart."""
        h, n = self.hidden, self.layers
        return {"embed": (h, 1), **{name: (w, n) for name, w in self.layer_tap_widths}, "final_norm": (h, 1)}

    def tap_elements_per_token(self, taps: frozenset[str]) -> int:
        """Elements of every selected tap but the logits, per token of one sequence (one side)."""
        return sum(width * count for name, (width, count) in self.tap_widths().items() if name in taps)

    def stacked_elements_per_token(self, taps: frozenset[str]) -> int:
        """Of those, the elements of taps that share their width with another selected tap: runs/capture.py stacks these
        into one pair per width, a copy of both sides (a tap alone in its width is reduced as a view)."""
        by_width: dict[int, list[int]] = {}
        for name, (width, count) in self.tap_widths().items():
            if name in taps:
                by_width.setdefault(width, []).append(count)
        return sum(width * sum(counts) for width, counts in by_width.items() if sum(counts) > 1)

    def fused_views_retained_per_token(self, taps: frozenset[str]) -> int:
        """Elements per token that vLLM's hand-over keeps alive beyond the taps themselves: a tap that is a view of a
        fused output (v_proj of qkv_proj's; gate_proj and up_proj of gate_up_proj's; Qwen2's q_rope and k_rope, which
        RoPE writes in place into qkv_proj's output) keeps that whole buffer, of which only the selected views are
        counted as taps. q_proj and k_proj are clones (engines/vllm/step.py REWRITTEN); Qwen3 rotates its q/k norms' outputs."""
        q, kv, i = self.q_width, self.kv_width, self.intermediate
        qkv_views = {"v_proj": kv} | ({} if self.qk_norm else {"q_rope": q, "k_rope": kv})
        fused = [(q + 2 * kv, qkv_views), (2 * i, {"gate_proj": i, "up_proj": i})]
        extra = 0
        for width, views in fused:
            held = [w for name, w in views.items() if name in taps]
            if held:
                extra += width - sum(held)
        return extra * self.layers

    def kv_bytes_per_token(self, kv_dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_width * kv_dtype_bytes


def parse_bytes(text: str, env: str = ENV) -> int:
    """`80000000000`, `8e10`, `80GB`, `74.5GiB`, `512MiB`: a byte count."""
    m = re.fullmatch(r"\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[0-9]+)?)\s*([kmgt]i?b?)?\s*", text.lower())
    if not m:
        raise DeviceMemoryError(f"{env}={text!r} is not a byte count; give bytes (80000000000) or e.g. 80GB, 74.5GiB")
    scale = {None: 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
             "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": GiB, "gib": GiB, "ti": 1 << 40,
             "tib": 1 << 40}[m.group(2)]
    count = float(m.group(1)) * scale
    if not 0 < count <= MAX_DEVICE_BYTES:  # 1e999 is inf: no int holds it, and no device is that large
        raise DeviceMemoryError(f"{env}={text!r} must be positive and at most {MAX_DEVICE_BYTES >> 50} PiB; give "
                                "the device's bytes (e.g. 80GB)")
    value = int(count)
    return value


def gib(n: int) -> str:
    """Bytes as a user reads them in a one-line error: GiB, or MiB below a tenth of one."""
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


def device_memory(device: str) -> tuple[int, int, str]:
    """(free bytes, total bytes, where the free count came from) of a device a stack loads on ("cpu", "cuda",
    "cuda:N"). The override caps the free memory of each device (a GPU shared with others, or a test); on the CPU the
    memory is the system's RAM."""
    override = os.environ.get(ENV)
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device) if ":" in device else None)
        source = "torch.cuda.mem_get_info" + (f"({device})" if ":" in device else "")
    else:
        free, total = system_memory()
        source = "system RAM available"
    if override:
        return parse_bytes(override), total, f"{ENV}"
    return free, total, source


def system_memory() -> tuple[int, int]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:
        pages = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * pages, os.sysconf("SC_PHYS_PAGES") * pages
