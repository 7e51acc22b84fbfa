"""Canonical tap points: the names every stack maps its intermediate tensors to.

A tap is identified by (name, layer). Decoder-layer taps carry their layer index 0..L-1; the model-level
taps use layer -1 (`embed`) and L (`final_norm`, `logits`), so sorting by `forward_order` walks the model
in the order data flows through it, which is what "first divergence" means.

Every captured tensor is handed over in one layout, `[tokens, features]` for one prompt (heads flattened
into features), so the metrics never need to know which stack produced it; or several taps of one width at once,
stacked as `[taps, tokens, features]` under a tuple of keys (`Tap`), which saves a stack one hand-over per tap.

The vocabulary imports nothing, so that naming a tap puts no module deeper in the import graph; the `--taps` value
is read into names, and refused, in tap_selection.py.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence, Union

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing the module (the CLI's --help) needs no torch
    import torch

MODEL_TAPS_BEFORE = ("embed",)
# Every family's layer taps, in dataflow order; a family has a subset of them (models/: `Family.layer_taps`).
LAYER_TAPS = (
    "input_norm",
    "q_proj",  # q/k/v projection outputs (vLLM: split from its fused qkv_proj); Qwen3: before q_norm/k_norm
    "k_proj",
    "v_proj",
    "q_norm",  # per-head RMSNorm of the query projection, where the family has one (Qwen3)
    "k_norm",
    "q_rope",
    "k_rope",
    "attn_core",  # attention output before o_proj
    "attn_out",  # after o_proj
    "resid_mid",  # residual stream after the attention add
    "post_norm",
    "router_logits",  # a mixture-of-experts router's logits, [tokens, experts] (Qwen3-MoE); dense layers have none
    "gate_proj",  # gate/up projection outputs (vLLM: split from its fused gate_up_proj)
    "up_proj",
    "swiglu",  # input of down_proj: silu(gate) * up
    "mlp_out",
    "resid_out",  # residual stream after the MLP add
)
MODEL_TAPS_AFTER = ("final_norm", "logits")
ALL_TAPS = MODEL_TAPS_BEFORE + LAYER_TAPS + MODEL_TAPS_AFTER
# What an engine hands over beside its taps and that is never diffed against the trainer: the experts each token of a
# mixture-of-experts layer was sent to and their weights, as the engine's router chose them ([tokens, top_k]). They
# travel through the same sink as taps (a stack splits its step rows per sequence the same way) and are consumed by
# the routing capture (runs/route_capture.py), not by the tap pairing.
ROUTE_RECORDS = ("expert_ids", "expert_weights")
_ORDER = {name: i for i, name in enumerate(ALL_TAPS + ROUTE_RECORDS)}


class TapKey(NamedTuple):
    """One tap of one layer. Ordered by data flow: embed, layer 0 taps, ..., final_norm, logits.

    A tuple, not a dataclass: keys are hashed several times per captured tensor, and a tuple hashes in C."""

    order: tuple[int, int]
    name: str
    layer: int

    @classmethod
    def of(cls, name: str, layer: int) -> "TapKey":
        return cls(order=(layer, _ORDER[name]), name=name, layer=layer)

    @property
    def label(self) -> str:
        return f"{self.name}@{self.layer}"


Tap = Union[TapKey, tuple[TapKey, ...]]
"""What a hand-over holds: one tap (`[tokens, features]`), or a tuple of taps stacked in that order."""


def each_tap(tap: Tap, tensor: torch.Tensor) -> Iterator[tuple[TapKey, torch.Tensor]]:
    """A hand-over as (key, [tokens, features]) pairs, for consumers that keep taps one by one."""
    if isinstance(tap, TapKey):
        yield tap, tensor
    else:
        yield from zip(tap, tensor.unbind(0))


def expected_taps(selected: frozenset[str], num_layers: int, layer_taps: Sequence[str]) -> list[TapKey]:
    """Every (tap, layer) a model must produce for this selection, in forward order. `layer_taps`: the decoder-layer
    taps its family has (models/: `family.layer_taps`)."""
    keys = []
    for name in ALL_TAPS:
        if name not in selected or (name in LAYER_TAPS and name not in layer_taps):
            continue
        if name in MODEL_TAPS_BEFORE:
            keys.append(TapKey.of(name, -1))
        elif name in MODEL_TAPS_AFTER:
            keys.append(TapKey.of(name, num_layers))
        else:
            keys.extend(TapKey.of(name, i) for i in range(num_layers))
    return sorted(keys)
