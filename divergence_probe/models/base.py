"""What a model family is, as data: the decoder layer's taps, where each stack keeps its modules, how vLLM fuses them.

    family = get_family("qwen3")                  # models/__init__.py: registry by config.json's model_type
    family.layer_taps                             # ("input_norm", "q_proj", ..., "resid_out"): this family's taps
    family.hf.seams / family.vllm.seams           # which module each tap is read at, and how (the stack says how)
    find(layer, family.vllm.layer["rotary"])      # a module by its role, looked up when called

A module is named by a *role* (the canonical name of what it does: "input_norm", "attn", "down_proj") and each stack's
layout maps roles to dotted paths: model-level roles from the causal LM (`model.layers`), layer-level roles from one
decoder layer (`self_attn.q_proj`). Consumers (stacks, regions, rl's sync check, checkpoint checks) ask for roles and
never spell a path, so a new family is one module here plus one registry line (torchtitan's model_spec and
state-dict adapter, vLLM's `packed_modules_mapping`, are the models for this).

Seams say *where* a tap is read; *how* a read kind is done is the stack's code (engines/hf/trainer.py, engines/vllm/seams.py),
so this package imports nothing above it: no stacks, no regions, no orchestration.

A mixture-of-experts family (Qwen3-MoE) adds roles for the router (`mlp.gate` on both stacks) and the experts, a
`router_logits` seam, and its experts' checkpoint tensors. TODO: every layer of a family reads the same
seams today; a family with dense layers among sparse ones (`mlp_only_layers`, `decoder_sparse_step`) needs the
seams, widths and checkpoint names chosen per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

import re

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing the module (the CLI's --help) needs no torch
    import torch


@dataclass(frozen=True)
class Seam:
    """Where one stack reads some taps: a module of the decoder layer (a role of the layout; "" is the layer itself)
    and what of it (`read`: a kind the stack's hook code knows, e.g. "output", "input", "split")."""

    taps: tuple[str, ...]  # the canonical taps read here, in the order the read returns them
    module: str  # a role of StackLayout.layer, or "" for the decoder layer
    read: str = "output"
    arg: tuple[int, str] | None = None  # read of an input: the argument's position and keyword


@dataclass(frozen=True)
class Fused:
    """One of vLLM's fused GEMMs: the trainer's modules it stacks (in this order along the output features) and the
    width of each part, as a dimension name of `dims` (None: equal parts). The same order splits its output into
    the canonical taps and stacks the trainer's weights into it (rl's sync check)."""

    module: str  # vLLM role of the fused module (StackLayout.layer)
    parts: tuple[str, ...]  # the trainer's module names it packs; also the taps its output splits into
    sizes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class StackLayout:
    """Where one stack (transformers or vLLM) keeps a family's modules, and where its hooks read each tap."""

    model: Mapping[str, str]  # role -> path from the causal LM: embed, layers, final_norm, lm_head, ...
    layer: Mapping[str, str]  # role -> path from one decoder layer
    seams: tuple[Seam, ...]  # the layer's taps, in the order its forward reaches them
    regions: Mapping[str, str] = field(default_factory=dict)  # region -> the layer role its patch targets


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type (the registry key; transformers builds from it)
    architecture: str  # config.json's architectures[0] (vLLM builds from it)
    layer_taps: tuple[str, ...]  # the canonical decoder-layer taps this family has, in dataflow order
    widths: Mapping[str, str]  # layer tap -> dimension name of `dims` (features of one row)
    hf: StackLayout
    vllm: StackLayout
    fused: tuple[Fused, ...]  # vLLM's packed modules (its packed_modules_mapping)
    checkpoint: Mapping[str, tuple[str, ...]]  # per-layer tensor (after `model.layers.N.`) -> config fields sizing it
    model_tensors: Mapping[str, tuple[str, ...]]  # model-level tensor -> config fields sizing it
    tied_head: tuple[str, str] = ("lm_head.weight", "model.embed_tokens.weight")  # (head, the embedding it ties to)
    required_config: tuple[str, ...] = ()  # config fields this family needs beyond checkpoint.REQUIRED_FIELDS
    # config fields of which config.json must have at least one (aliases: transformers saves one name, the hub another)
    required_any: tuple[tuple[str, ...], ...] = ()
    # config fields whose value must be this (absent: transformers' default, which is this): layouts not described yet
    fixed_config: Mapping[str, object] = field(default_factory=dict)
    experts: tuple["ExpertTensors", ...] = ()  # transformers' fused expert parameters and their per-expert layout
    engine_experts: "EngineExperts | None" = None  # where vLLM's MoE loader puts the trainer's experts (rl's sync)
    # what this family cannot do yet: feature (spec/'s names: compiled, graft, depth, align, ablate, rl) -> why
    unsupported: Mapping[str, str] = field(default_factory=dict)
    top_k_field: str | None = None  # config field of the router's top-k (a mixture of experts; None: dense)
    # layer taps that vLLM's tensor parallelism splits along the features, each rank holding its heads or columns in
    # rank order: a column-parallel GEMM's output and what stays per head or per column after it, up to the
    # row-parallel GEMM (o_proj, down_proj) whose all-reduced output, and the residual stream, every rank holds whole
    column_parallel: frozenset[str] = frozenset()

    @property
    def packed(self) -> dict[str, tuple[str, ...]]:
        """vLLM's packed_modules_mapping: fused module name -> the trainer's modules stacked into it, in order."""
        return {self.vllm.layer[f.module].rpartition(".")[2]: f.parts for f in self.fused}

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
        prefix = self.hf.model["layers"]
        return names | {f"{prefix}.{i}.{n}" for i in range(num_layers) for n in local}

    def shape_fields(self, name: str) -> tuple[str, ...]:
        """The config fields that size checkpoint tensor `name` (to say which field a wrong shape contradicts)."""
        if name in self.model_tensors:
            return self.model_tensors[name]
        prefix = self.hf.model["layers"] + "."
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


@dataclass(frozen=True)
class EngineExperts:
    """vLLM's expert tensors of one MoE layer, which its MoE loader fills (not packed_modules_mapping): each is one of
    the trainer's fused expert parameters, copied as it is, then laid out by the experts kernel's post-load processing
    (rl's sync check reads both: which trainer tensor, and that the kernel's layout applies)."""

    module: str  # vLLM role (StackLayout.layer) of the module holding them
    tensors: Mapping[str, str]  # its parameter -> the trainer's per-layer tensor loaded into it (after model.layers.N.)


def dims(config, shards: int = 1) -> dict[str, int]:
    """The dimension names `Family.widths` and `Fused.sizes` use, from a transformers config; `shards`: one tensor-
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
