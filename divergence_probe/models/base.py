"""What a model family is, as data, whichever engine runs it: the decoder layer's taps and their widths, the
checkpoint's tensors and the config fields sizing them, what the family cannot do yet.

    family = get_family("qwen3")                  # models/__init__.py: registry by config.json's model_type
    family.layer_taps                             # ("input_norm", "q_proj", ..., "resid_out"): this family's taps
    family.widths["q_proj"]                       # "q": a dimension name of `dims`

Where an engine keeps the family's modules, and where it reads each tap, is that engine's (engines/layouts.py and
each engine's layouts.py), so this package imports nothing above it: no engines, no regions, no orchestration. A
new family is one module here, one registry line, and one layout entry per engine.

A mixture-of-experts family (Qwen3-MoE) adds a `router_logits` tap and its experts' checkpoint tensors. TODO: every
layer of a family reads the same seams today; a family with dense layers among sparse ones (`mlp_only_layers`,
`decoder_sparse_step`) needs the seams, widths and checkpoint names chosen per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

import re

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing the module (the CLI's --help) needs no torch
    import torch


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type (the registry key; transformers builds from it)
    architecture: str  # config.json's architectures[0] (the class an engine builds)
    layer_taps: tuple[str, ...]  # the canonical decoder-layer taps this family has, in dataflow order
    widths: Mapping[str, str]  # layer tap -> dimension name of `dims` (features of one row)
    checkpoint: Mapping[str, tuple[str, ...]]  # per-layer tensor (after `model.layers.N.`) -> config fields sizing it
    model_tensors: Mapping[str, tuple[str, ...]]  # model-level tensor -> config fields sizing it
    layer_prefix: str = "model.layers"  # what a checkpoint's per-layer tensor names start with (then `.N.`)
    tied_head: tuple[str, str] = ("lm_head.weight", "model.embed_tokens.weight")  # (head, the embedding it ties to)
    required_config: tuple[str, ...] = ()  # config fields this family needs beyond checkpoint.REQUIRED_FIELDS
    # config fields of which config.json must have at least one (aliases: transformers saves one name, the hub another)
    required_any: tuple[tuple[str, ...], ...] = ()
    # config fields whose value must be this (absent: transformers' default, which is this): layouts not described yet
    fixed_config: Mapping[str, object] = field(default_factory=dict)
    experts: tuple["ExpertTensors", ...] = ()  # transformers' fused expert parameters and their per-expert layout
    # what this family cannot do yet: feature (spec/'s names: compiled, graft, depth, align, ablate, rl) -> why
    unsupported: Mapping[str, str] = field(default_factory=dict)
    top_k_field: str | None = None  # config field of the router's top-k (a mixture of experts; None: dense)
    # layer taps that tensor parallelism (Megatron's, vLLM's) splits along the features, each rank holding its heads or
    # columns in rank order: a column-parallel GEMM's output and what stays per head or per column after it, up to the
    # row-parallel GEMM (o_proj, down_proj) whose all-reduced output, and the residual stream, every rank holds whole
    column_parallel: frozenset[str] = frozenset()

    def tensor_names(self, num_layers: int, tied: bool, num_experts: int = 0) -> set[str]:
        """Every tensor name a checkpoint of this family holds (a tied head: none of its own), experts in the
        per-expert layout that transformers saves by default (`experts.*.` once for each of num_experts)."""
        names = {n for n in self.model_tensors if not (tied and n == self.tied_head[0])}
        fused = {experts.fused for experts in self.experts}
        local = set()
        for name in self.checkpoint:
            if name in fused:
                continue
            local |= {name.replace("*", str(e)) for e in range(num_experts)} if "*" in name else {name}
        prefix = self.layer_prefix
        return names | {f"{prefix}.{i}.{n}" for i in range(num_layers) for n in local}

    def shape_fields(self, name: str) -> tuple[str, ...]:
        """The config fields that size checkpoint tensor `name` (to say which field a wrong shape contradicts)."""
        if name in self.model_tensors:
            return self.model_tensors[name]
        prefix = self.layer_prefix + "."
        local = name[len(prefix):].partition(".")[2] if name.startswith(prefix) else name
        local = re.sub(r"experts\.\d+\.", "experts.*.", local)  # one expert's tensor: sized like every expert's
        return self.checkpoint.get(local, ("hidden_size",))

    def as_saved(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's tensors by the names and shapes transformers saves a checkpoint with by default: each fused
        expert parameter as its per-expert tensors (views of it, no copies). A weight push sends these because they
        are what every vLLM's MoE loader reads; vLLM 0.24's Qwen3-MoE loader skips the fused name without a word,
        which left an engine computing with its old experts after a push."""
        for name, tensor in named:
            experts = next((x for x in self.experts if name.endswith("." + x.fused)), None)
            if experts is None:
                yield name, tensor
                continue
            layer = name[: -len(experts.fused)]
            for e in range(tensor.shape[0]):
                for part, rows in zip(experts.parts, tensor[e].chunk(len(experts.parts))):
                    yield layer + part.format(e=e), rows

    def checkpoint_shapes(self, expected: Mapping[str, tuple[int, ...]], found) -> dict[str, tuple[int, ...]]:
        """transformers' state-dict shapes (`expected`, from the model built on the meta device) as a checkpoint with
        the tensor names `found` stores them: a fused expert parameter stays fused where the checkpoint has it, else
        it is the per-expert tensors transformers loads it from (and saves it as by default), layer by layer."""
        shapes = dict(expected)
        for name, shape in expected.items():
            for experts in self.experts:
                if not name.endswith("." + experts.fused) or name in found:
                    continue
                layer = name[: -len(experts.fused)]
                del shapes[name]
                rows = shape[1] // len(experts.parts)
                for e in range(shape[0]):
                    for part in experts.parts:
                        shapes[layer + part.format(e=e)] = (rows, *shape[2:])
        return shapes


@dataclass(frozen=True)
class ExpertTensors:
    """One of transformers' fused expert parameters ([experts, rows, cols], per layer) and the per-expert tensors a
    checkpoint may store it as instead, concatenated in this order along the rows (transformers' conversion mapping:
    gate_up_proj[e] = cat(gate_proj_e, up_proj_e))."""

    fused: str  # per-layer name, e.g. "mlp.experts.gate_up_proj"
    parts: tuple[str, ...]  # per-layer names with "{e}" for the expert index


def dims(config, shards: int = 1) -> dict[str, int]:
    """The dimension names `Family.widths` and an engine's fused GEMMs (engines/layouts.py) use, from a transformers config; `shards`: one tensor-
    parallel rank's of `shards` (its heads and MLP columns; a KV head is replicated when there are fewer than ranks,
    as vLLM does)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    sizes = {"hidden": config.hidden_size, "q": heads // shards * head_dim,
             "kv": max(1, config.num_key_value_heads // shards) * head_dim,
             "inter": config.intermediate_size // shards, "vocab": config.vocab_size}
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:  # a mixture of experts: the router's logits have one feature per expert
        sizes["experts"] = experts
    return sizes


def find(root: torch.nn.Module, path: str):
    """The module (or attribute) at a dotted path from `root`, looked up now ("" is root); None where absent. Looked up
    at call time on purpose: a region patch or a replay's stub swaps children, and callers must see the swap."""
    obj = root
    for part in path.split(".") if path else ():
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
