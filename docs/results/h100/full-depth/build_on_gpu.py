"""Build make-model's random checkpoint of a published shape on the GPU, in seconds rather than the host's minutes.

    python3 build_on_gpu.py PRESET OUT_DIR [SEED]

The same config, tokenizer and initialisation as `divergence-probe make-model --preset PRESET` (RMSNorm weights
N(1, 0.1), biases drawn), drawn by the GPU's generator, so the bytes differ from a CPU build of the same seed.
Written here rather than by save_pretrained, which converts a mixture's fused expert tensors back to the hub's
one-tensor-per-expert names on the device, a second copy of the experts that a model near the device's size has no
room for: the same names, one 5 GB shard at a time copied to the host.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from divergence_probe.models.modelzoo import _random_model, build_tokenizer, make_config

SHARD_BYTES = 5 * 10**9


def hub_tensors(model):
    """(name, tensor) in the hub's layout: a fused experts tensor [experts, 2 * width, hidden] is its experts'
    gate_proj then up_proj halves (transformers' qwen2_moe conversion concatenates them in that order). A tied
    tensor is written once, under its first name, as save_pretrained does."""
    seen = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", t[e, :half]
                yield f"{prefix}{e}.up_proj.weight", t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def save(model, out: Path) -> None:
    shards, shard, size = [], {}, 0
    for name, t in hub_tensors(model):
        if shard and size + t.numel() * t.element_size() > SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
        shard[name], size = t, size + t.numel() * t.element_size()
    shards.append(shard)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.to("cpu").contiguous() for k, v in shard.items()}, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
        total += sum(v.numel() * v.element_size() for v in shard.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    model.config.architectures = [type(model).__name__]  # save_pretrained's own: both stacks pick the class by it
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def main(preset: str, out_dir: str, seed: int = 0) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)
    config = make_config(preset=preset)
    build_tokenizer(model_max_length=config.max_position_embeddings).save_pretrained(out)
    model = _random_model(config, seed, device="cuda")
    print(f"device peak while drawing: {torch.cuda.max_memory_allocated() / 1e9:.1f} GB")
    save(model, out)
    print(f"{preset}: {sum(p.numel() for p in model.parameters()):,} parameters in {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
