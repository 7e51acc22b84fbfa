"""The FP32 head on transformers: the lm_head Linear computes the region's FP32 logits (regions/lm_head.py)."""

from __future__ import annotations

import torch

from ....regions.lm_head import head
from ...hooks import Replacement
from ...layouts import child, model_part


def patch(model: torch.nn.Module) -> list[Replacement]:
    """transformers' head is an nn.Linear whose output the causal LM returns as its logits."""
    lm_head = model_part(model, "hf", "lm_head")
    child(lm_head, "weight", "the lm_head")
    return [Replacement(lm_head, "forward", lambda x: head(x, lm_head.weight, lm_head.bias))]
