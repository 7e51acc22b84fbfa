"""The vLLM engine's weight session, the parts that need no engine."""

from __future__ import annotations

import torch

from divergence_probe.engines.vllm.weights import moved_storage, storage


def test_moved_storage_names_a_parameter_given_new_storage():
    """What a captured CUDA graph would miss: a tensor replaced rather than copied into."""
    layer = torch.nn.Linear(4, 4)
    before = storage(layer)
    with torch.no_grad():
        layer.weight.copy_(torch.ones(4, 4))  # in place, as vLLM's reload copies
    assert moved_storage(before, layer) == []
    layer.bias.data = torch.zeros(4)
    assert moved_storage(before, layer) == ["bias"]
