"""The H200 MoE routing runs (docs/results/h200/moe/README.md): the Qwen3-30B-A3B layer shape, cut to a depth that
fits one GPU with both stacks, built on the GPU, loaded once, and run as the CLI would run these commands:

    divergence-probe compare --model M --device cuda --num-prompts 16 --max-prompt-tokens 512 --batch-invariance
    divergence-probe compare ... --align routing
    divergence-probe compare ... --align routing --routing-replay ids+weights
    divergence-probe ablate  ... --regions rope,rmsnorm,routing --bootstrap 200

(one load for all four, which on the lent GPU saves three loads of both stacks; each run folder's manifest holds the
spec that re-makes it with `rerun`). usage, as two device calls (each under the call limit):
    python3 routing_job.py build LAYERS MODEL_DIR      # the weights stay in MODEL_DIR, on the device machine
    python3 routing_job.py run MODEL_DIR OUT
"""

import sys
import time
from pathlib import Path

import torch

import divergence_probe as dp
from divergence_probe import modelzoo as z

def build(layers: int, model: Path) -> None:
    t = time.time()
    model.mkdir(parents=True)
    cfg = z.make_config(arch="qwen3_moe", preset="qwen3-30b-a3b", num_layers=layers)
    z.build_tokenizer(model_max_length=cfg.max_position_embeddings).save_pretrained(model)
    with torch.device("cuda"):
        z._random_model(cfg, 0).save_pretrained(model, max_shard_size="1000GB")
    print(f"built qwen3-30b-a3b x {layers} layers on the GPU in {time.time() - t:.0f} s", flush=True)


def run(model: Path, out: Path) -> None:
    prompts = {"num_prompts": 16, "max_prompt_tokens": 512}
    t = time.time()
    probe = dp.load(str(model), infer="vllm", dtype="bfloat16", device="cuda")
    print(f"loaded both stacks in {time.time() - t:.0f} s", flush=True)
    runs = (("shipped", dict(batch_invariance=True)), ("r3", dict(align="routing")),
            ("ids_weights", dict(align="routing", routing_replay="ids+weights")))
    for name, options in runs:
        t = time.time()
        probe.compare(taps="all", **prompts, **options).write(out / name)
        print(f"{name}: {time.time() - t:.0f} s", flush=True)
    t = time.time()
    probe.ablate(taps="all", regions="rope,rmsnorm,routing", bootstrap=200, **prompts).write(out / "ablate")
    print(f"ablate: {time.time() - t:.0f} s", flush=True)
    probe.close()


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(int(sys.argv[2]), Path(sys.argv[3]))
    else:
        run(Path(sys.argv[2]), Path(sys.argv[3]))
