"""hub_layout: the writer a GPU build of make-model uses writes what save_pretrained writes (the same tensor names,
shapes and values, config and generation config), sharded with an index when the weights exceed one shard, the same
bytes for the same model, and transformers and the checkpoint check load it. Built on the CPU: the writer only copies,
so the device the weights lie on does not change what it writes.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from divergence_probe.models.checkpoint import INDEX_FILE, SINGLE_FILE, check_weights, checkpoint_tensors
from divergence_probe.models import get_family
from divergence_probe.models.hub_layout import save_hub_layout
from divergence_probe.models.modelzoo import _random_model, make_config

ARCHS = ("qwen2", "qwen3", "qwen3_moe")
SHARD = 2**20  # the tiny models are 2 to 8 MB: several shards


@pytest.fixture(scope="module")
def checkpoints(qwen2_tiny, qwen3_tiny, qwen3_moe_tiny):
    """make-model's CPU builds (save_pretrained), seed 0."""
    return {"qwen2": qwen2_tiny, "qwen3": qwen3_tiny, "qwen3_moe": qwen3_moe_tiny}


def written(arch: str, out, shard_bytes: int):
    """The seed-0 tiny model of `arch` as make-model draws it on the CPU, written by the hub-layout writer."""
    out.mkdir()
    model = _random_model(make_config(arch=arch), 0)
    save_hub_layout(model, out, get_family(arch), shard_bytes)
    return model


def tensors(folder) -> dict[str, torch.Tensor]:
    loaded = {}
    for shard in sorted(folder.glob("*.safetensors")):
        loaded |= load_file(shard)
    return loaded


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shard_bytes", [SHARD, 10**9], ids=["sharded", "one-file"])
def test_the_writer_writes_what_save_pretrained_writes(arch, shard_bytes, checkpoints, tmp_path):
    reference = checkpoints[arch]
    written(arch, tmp_path / "w", shard_bytes)
    ours, theirs = tensors(tmp_path / "w"), tensors(reference)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "w" / name).read_text()) == json.loads((reference / name).read_text()), name
    shards = sorted(p.name for p in (tmp_path / "w").glob("*.safetensors"))
    if shard_bytes == SHARD:
        assert len(shards) > 1 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
        assert (tmp_path / "w" / INDEX_FILE).is_file()
    else:
        assert shards == [SINGLE_FILE] and not (tmp_path / "w" / INDEX_FILE).exists()


def test_same_model_same_bytes(tmp_path):
    for name in ("a", "b"):
        written("qwen3_moe", tmp_path / name, SHARD)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir()) and INDEX_FILE in files
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_shards_pass_the_checkpoint_check_and_load_in_transformers(tmp_path):
    """The sharded mixture of experts: the check both stacks' loads start with accepts it, and transformers merges the
    per-expert tensors back into the model that was drawn."""
    model = written("qwen3_moe", tmp_path / "w", SHARD)
    config = json.loads((tmp_path / "w" / "config.json").read_text())
    check_weights(tmp_path / "w", config)
    assert len({t.file for t in checkpoint_tensors(tmp_path / "w").values()}) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "w")
    drawn = model.state_dict()
    assert loaded.state_dict().keys() == drawn.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, drawn[name]), name
