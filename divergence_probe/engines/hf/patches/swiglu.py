"""SwiGLU on transformers: the dense MLP's forward computes the region's silu(gate)*up with one rounding
(regions/swiglu.py)."""

from __future__ import annotations

import torch

from ....errors import ProbeError
from ....models import find
from ....regions.swiglu import swiglu
from ...hooks import Replacement
from ...layouts import decoder_layers, layer_name, layout_of, part


def patch(model: torch.nn.Module) -> list[Replacement]:
    if model.config.hidden_act != "silu":
        raise ProbeError(f"aligned SwiGLU needs hidden_act='silu', not {model.config.hidden_act!r}: leave swiglu "
                         "out of the aligned regions")
    found = []
    hf = layout_of(model, "hf")
    for i, layer in enumerate(decoder_layers(model, "hf")):
        where = layer_name(hf, i)
        mlp = part(layer, where, hf, hf.regions["swiglu"])
        for role in ("gate_proj", "up_proj", "down_proj"):
            part(layer, where, hf, role)
        gate, up, down = (hf.layer[role] for role in ("gate_proj", "up_proj", "down_proj"))

        def forward(x, layer=layer, gate=gate, up=up, down=down):  # looked up per call: a replay stubs them
            return find(layer, down)(swiglu(find(layer, gate)(x), find(layer, up)(x)))

        found.append(Replacement(mlp, "forward", forward))
    return found
