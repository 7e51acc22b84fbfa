"""Where an engine keeps a family's modules, as data: each engine package's `layouts.py` holds one per model_type.

    layout = lookup("vllm", "qwen3")              # engines/vllm/layouts.py: LAYOUTS["qwen3"]
    layout.seams                                  # which module each tap is read at, and how (the engine says how)
    find(layer, layout.layer["rotary"])           # a module by its role, looked up when called

A module is named by a *role* (the canonical name of what it does: "input_norm", "attn", "down_proj") and each
engine's layout maps roles to dotted paths: model-level roles from the causal LM (`model.layers`), layer-level roles
from one decoder layer (`self_attn.q_proj`). Consumers (engines, region patches, rl's sync check) ask for roles and
never spell a path. The family (models/) says what a tap means and how wide it is; the layout says where one engine
reads it, so a new family is its models/ module plus one layout entry per engine, and a new engine brings its own
layouts without touching models/ (torchtitan's model_spec and state-dict adapter, vLLM's `packed_modules_mapping`,
are the models for this).

Seams say *where* a tap is read; *how* a read kind is done is the engine's code (engines/hf/trainer.py,
engines/vllm/seams.py). Walking a loaded model along its layout (`decoder_layers`, `part`) is here too, below the
patches and kernel sets that use it: a missing part is SeamMissing, naming where it was looked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from typing import Mapping

from ..errors import ProbeError


@dataclass(frozen=True)
class Seam:
    """Where one engine reads some taps: a module of the decoder layer (a role of the layout; "" is the layer itself)
    and what of it (`read`: a kind the engine's hook code knows, e.g. "output", "input", "split")."""

    taps: tuple[str, ...]  # the canonical taps read here, in the order the read returns them
    module: str  # a role of StackLayout.layer, or "" for the decoder layer
    read: str = "output"
    arg: tuple[int, str] | None = None  # read of an input: the argument's position and keyword


@dataclass(frozen=True)
class Fused:
    """One fused GEMM of an engine: the trainer's modules it stacks (in this order along the output features) and the
    width of each part, as a dimension name of `models.dims` (None: equal parts). The same order splits its output
    into the canonical taps and stacks the trainer's weights into it (rl's sync check)."""

    module: str  # role of the fused module (StackLayout.layer)
    parts: tuple[str, ...]  # the trainer's module names it packs; also the taps its output splits into
    sizes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class EngineExperts:
    """An engine's expert tensors of one MoE layer, which its MoE loader fills (not its packed modules): each is one of
    the trainer's fused expert parameters, copied as it is, then laid out by the experts kernel's post-load processing
    (rl's sync check reads both: which trainer tensor, and that the kernel's layout applies)."""

    module: str  # role (StackLayout.layer) of the module holding them
    tensors: Mapping[str, str]  # its parameter -> the trainer's per-layer tensor loaded into it (after model.layers.N.)


@dataclass(frozen=True)
class StackLayout:
    """Where one engine keeps a family's modules, where its hooks read each tap, and what it fuses."""

    model: Mapping[str, str]  # role -> path from the causal LM: embed, layers, final_norm, lm_head, ...
    layer: Mapping[str, str]  # role -> path from one decoder layer
    seams: tuple[Seam, ...]  # the layer's taps, in the order its forward reaches them
    regions: Mapping[str, str] = field(default_factory=dict)  # region -> the layer role its patch targets
    fused: tuple[Fused, ...] = ()  # the engine's packed modules (vLLM's packed_modules_mapping)
    experts: EngineExperts | None = None  # where the engine's MoE loader puts the trainer's experts (rl's sync)

    @property
    def packed(self) -> dict[str, tuple[str, ...]]:
        """The packed_modules_mapping: fused module name -> the trainer's modules stacked into it, in order."""
        return {self.layer[f.module].rpartition(".")[2]: f.parts for f in self.fused}


def lookup(engine: str, model_type: str) -> StackLayout:
    """The layout of `model_type` on `engine` (engines/<engine>/layouts.py, imported when first asked for); a family
    the engine has no layout of is a one-line error listing those it has."""
    package = f"divergence_probe.engines.{engine}"
    try:
        layouts = import_module(f"{package}.layouts").LAYOUTS
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith(package):
            raise
        raise ProbeError(f"the {engine} engine has no module layouts") from None
    if model_type not in layouts:
        raise ProbeError(f"the {engine} engine has no layout of model_type {model_type!r}; it knows: "
                         f"{', '.join(layouts)}")
    return layouts[model_type]


def layout_of(model, engine: str) -> StackLayout:
    """The layout of a loaded model of `engine` (both keep the transformers config as `model.config`)."""
    return lookup(engine, model.config.model_type)


def insert_after(seams: tuple[Seam, ...], module: str, *added: Seam) -> tuple[Seam, ...]:
    """`seams` with `added` inserted after the last seam at `module` (dataflow order): how a family that extends
    another's layer (Qwen3's q_norm/k_norm after Qwen2's projections) extends its layouts."""
    at = max(i for i, s in enumerate(seams) if s.module == module) + 1
    return seams[:at] + added + seams[at:]


def moe_seams(dense: tuple[Seam, ...], *router: Seam) -> tuple[Seam, ...]:
    """A mixture-of-experts layer's seams from its dense twin's: the attention's, then `router` (its logits, its choice
    of experts) and the MoE block's output, then the layer's output; a sparse layer has no dense gate/up/swiglu."""
    mlp = ("gate_proj", "up_proj", "swiglu", "mlp_out", "resid_out")
    attention = tuple(s for s in dense if not set(s.taps) & set(mlp))
    return attention + (*router, Seam(("mlp_out",), "mlp")) + dense[-1:]


def without(roles: Mapping[str, str], dropped: tuple[str, ...]) -> dict[str, str]:
    """`roles` without `dropped` (a MoE layer drops the dense MLP's roles)."""
    return {k: v for k, v in roles.items() if k not in dropped}


class SeamMissing(Exception):
    """Raised by a patcher: `what` it needs is absent from the model (`plan` names engine, version and region around
    it)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def child(obj, name: str, where: str):
    """obj.name, or SeamMissing naming `where` it was looked for."""
    value = getattr(obj, name, None)
    if value is None:
        raise SeamMissing(f"{name} in {where}")
    return value


def model_part(model, engine: str, role: str):
    """The model-level module of `role` (layers, final_norm, lm_head) of a loaded model of `engine`, or SeamMissing
    naming the first part of its path that is absent and where."""
    obj, where = model, "the model"
    for name in layout_of(model, engine).model[role].split("."):
        obj = child(obj, name, where)
        where = f"model.{name}" if where == "the model" else f"{where}.{name}"
    return obj


def decoder_layers(model, engine: str) -> list:
    """The decoder layers of a loaded model of `engine`, where its layout keeps them (Qwen2/Qwen3: model.layers)."""
    return list(model_part(model, engine, "layers"))


def part(layer, where: str, stack_layout: StackLayout, role: str):
    """The module of a decoder layer with this role in the engine's layout ("": the layer), or SeamMissing naming
    the first part of its path that is absent and where (`where`: the layer, e.g. model.model.layers[2])."""
    path = stack_layout.layer[role] if role else ""
    obj = layer
    for name in path.split(".") if path else ():
        obj = child(obj, name, where)
        where = f"{where}.{name}"
    return obj


def layer_name(stack_layout: StackLayout, i: int) -> str:
    """How messages name decoder layer i: as a path from the loaded model (`model.model.layers[2]`)."""
    return f"model.{stack_layout.model['layers']}[{i}]"
