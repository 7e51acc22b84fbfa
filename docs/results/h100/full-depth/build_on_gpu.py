"""Build make-model's random checkpoint of a published shape on the GPU, in seconds rather than the host's minutes.

    python3 build_on_gpu.py PRESET OUT_DIR [SEED]

The same config, tokenizer and initialisation as `divergence-probe make-model --preset PRESET` (RMSNorm weights
N(1, 0.1), biases drawn), drawn by the GPU's generator, so the bytes differ from a CPU build of the same seed. Written
in 5 GB shards: save_pretrained copies one shard at a time to the host, so a 60 GB model never sits in host memory
twice (once as tensors, once in a /dev/shm file).
"""

import sys
from pathlib import Path

import torch

from divergence_probe.models.modelzoo import _random_model, build_tokenizer, make_config


def main(preset: str, out_dir: str, seed: int = 0) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=False)
    config = make_config(preset=preset)
    build_tokenizer(model_max_length=config.max_position_embeddings).save_pretrained(out)
    model = _random_model(config, seed, device="cuda")
    print(f"device peak while drawing: {torch.cuda.max_memory_allocated() / 1e9:.1f} GB")
    model.save_pretrained(out, max_shard_size="5GB")
    print(f"{preset}: {sum(p.numel() for p in model.parameters()):,} parameters in {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
