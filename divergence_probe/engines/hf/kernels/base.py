"""The KernelSet type: which ops a trainer's forward runs, as a planned, undoable patch of the loaded model.

RL trainers do not all run transformers' eager ops: some enable Liger-Kernel's fused RMSNorm/RoPE/SwiGLU, some run
the inference engine's own kernels for those ops so that the two stacks share them. A kernel set says which of the
trainer's modules and functions it replaces (as the regions it overlaps: a region and a kernel set that patch the same
op cannot both hold it), where it can run, whether its ops have a backward (rl differentiates the trainer's forward),
and which package it needs. Its `plan` only finds (as a region's patcher does); the trainer applies the plan through
its HookSet, so the set is undone when the trainer closes or another set replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from typing import TYPE_CHECKING

from ....errors import ProbeError
from ...needs import Needs

if TYPE_CHECKING:  # annotations only: importing the module (the CLI's --help) needs no torch
    import torch

    from ...hooks import Replacement


@dataclass(frozen=True)
class KernelSet:
    name: str
    summary: str  # one line for --help: what runs in place of transformers' ops
    plan: Callable[["torch.nn.Module"], "list[Replacement]"]  # the loaded model -> its replacements (empty: none)
    overlaps: tuple[str, ...] = ()  # regions whose ops this set replaces on the trainer: aligned together, they conflict
    backward: bool = True  # whether its ops carry gradients (rl's trainer steps through them)
    needs: Needs = field(default_factory=Needs)  # the devices it runs on, the package it needs

    def check(self, device: str) -> None:
        """Refuse, before anything loads, a device its ops cannot run on or a package that is not installed."""
        self.needs.check(f"--train-kernels {self.name}", "the trainer", device,
                         f"use --train-kernels torch here, or run on a {self.needs.devices[0]} machine")

    def check_regions(self, regions: Sequence[str], side: str) -> None:
        """A region aligned on the trainer that patches an op this set replaces: one line naming both."""
        if side == "infer":
            return
        for region in regions:
            if region in self.overlaps:
                raise ProbeError(f"region {region} and --train-kernels {self.name} both replace the trainer's {region} "
                                 f"op; leave {region} out, align it with --side infer, or use --train-kernels torch")

    def check_backward(self) -> None:
        """rl differentiates the trainer's forward: a set whose ops have no backward cannot train."""
        if not self.backward:
            raise ProbeError(f"--train-kernels {self.name} runs ops without a backward, and rl trains through the "
                             "trainer's forward; use --train-kernels torch (or liger, on a GPU) for rl")


def modeling_modules(model) -> list:
    """The transformers modeling modules whose code the loaded model's attention layers run: where a kernel set
    replaces a module-level function (`apply_rotary_pos_emb`) that the layers call by name."""
    import sys

    from ....models import find
    from ...layouts import decoder_layers, layout_of

    attn = layout_of(model, "hf").layer["attn"]
    names = dict.fromkeys(type(find(layer, attn)).__module__ for layer in decoder_layers(model, "hf"))
    return [sys.modules[name] for name in names]
