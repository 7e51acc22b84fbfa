# Build a published shape's random-weight checkpoint on the GPU (seconds, not make-model's CPU minutes); the bytes
# differ from make-model's CPU build of the same seed, which is fine for a run that is compared only with itself.
import sys, time
from pathlib import Path
import torch
from divergence_probe import modelzoo as z
preset, out = sys.argv[1], Path(sys.argv[2])
t = time.time()
out.mkdir(parents=True)
cfg = z.make_config(preset=preset)
z.build_tokenizer(model_max_length=cfg.max_position_embeddings).save_pretrained(out)
with torch.device("cuda"):
    model = z._random_model(cfg, 0)
model.save_pretrained(out, max_shard_size="1000GB")
print(f"built {preset} on the GPU in {time.time() - t:.0f} s", flush=True)
