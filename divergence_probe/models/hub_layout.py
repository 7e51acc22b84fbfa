"""Write a model's weights where they lie, in the hub's layout, one shard at a time through the host.

    from divergence_probe.models.hub_layout import save_hub_layout
    save_hub_layout(model, Path("/tmp/qwen3-30b-a3b"), family)  # model on the GPU: the host holds one shard at a time

transformers' save_pretrained converts a mixture of experts' fused parameters back to the hub's per-expert tensors
on the model's device, a second copy of the experts that a model near the device's size has no room for. This writer
names the same tensors as views of the fused ones (Family.as_saved), copies them to the host shard by shard, and
writes what save_pretrained writes beside them: the shard index (when there is more than one shard), config.json with
`architectures` set (both stacks pick the model class by it) and generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

# save_pretrained's default shard size before transformers 5 (which writes 50 GB shards): the size of the hub's large
# checkpoints' shards, and what the host holds of the weights at a time.
SHARD_BYTES = 5 * 10**9


def hub_tensors(model, family) -> list[tuple[str, object]]:
    """(name, tensor) as save_pretrained names them: fused experts as per-expert views (`family`: the model's
    models.Family, given by the caller, which already holds it), a tied tensor once, under its first name in the state
    dict (the embedding, before the head tied to it)."""
    seen, named = set(), []
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            named.append((name, tensor))
    return list(family.as_saved(named))


def plan_shards(named: list[tuple[str, object]], shard_bytes: int) -> list[dict[str, object]]:
    """Consecutive tensors, a new shard whenever the next would take one past shard_bytes (a larger tensor alone)."""
    shards: list[dict[str, object]] = [{}]
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def save_hub_layout(model, out_dir: Path, family, shard_bytes: int = SHARD_BYTES) -> None:
    """Write the model's weights, config and generation config into the existing directory out_dir: one
    model.safetensors if it fits one shard, else model-0000i-of-0000n.safetensors and their index. The tensors are
    copied to the host one shard at a time; none is copied on the model's device."""
    from safetensors.torch import save_file
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME  # save_pretrained's file names

    shards = plan_shards(hub_tensors(model, family), shard_bytes)
    files = [SAFE_WEIGHTS_NAME] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file, shard in zip(files, shards):
        host = {name: tensor.to("cpu").contiguous() for name, tensor in shard.items()}
        save_file(host, str(out_dir / file), metadata={"format": "pt"})  # save_pretrained's metadata
        weight_map |= dict.fromkeys(shard, file)
        total += sum(t.numel() * t.element_size() for t in host.values())
        del host  # before the next shard's copy is made, so the host never holds two
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    model.config.architectures = [type(model).__name__]  # as save_pretrained sets it
    model.config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
