"""The second engine's region patches, one per region it takes (engines/patching.py applies them): where the
region's reference math goes in this engine's model."""

from __future__ import annotations

from divergence_probe.engines.hooks import Replacement
from divergence_probe.regions.swiglu import swiglu


def _swiglu(model) -> list[Replacement]:
    """Each layer's silu(gate) * up, in FP32 with one rounding (regions/swiglu.py)."""
    return [Replacement(layer, "act", swiglu) for layer in model.layers]


PATCHES = {"swiglu": _swiglu}
