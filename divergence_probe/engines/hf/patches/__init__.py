"""transformers's region patches, one module per region (engines/patching.py applies them)."""

from __future__ import annotations

from . import lm_head, residual, rmsnorm, rope, swiglu

PATCHES = {"rope": rope.patch, "swiglu": swiglu.patch, "rmsnorm": rmsnorm.patch, "lm_head": lm_head.patch,
           "residual": residual.patch}
