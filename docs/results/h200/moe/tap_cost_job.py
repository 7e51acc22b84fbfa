"""What taps cost a MoE compare on the H200 (issue 28's target: taps all <= 1.3x taps none), as a ratio in one run.

One load of both stacks (the Qwen3-30B-A3B layer shape cut to LAYERS layers, built on the GPU as routing_job.py
builds it), then ROUNDS rounds of the same compare with `--taps all` and with `--taps none`, in an order that
alternates each round (so a slow spell hits both alike); the first round is a warm-up and is left out. The ratio is
the median of the per-round ratios, beside the ratio of the medians. The eager engine (the compiled one builds its tap
points into the engine, so its taps-none run would not be an untapped engine; benchmarks/bench_compiled_taps.py is
the compiled-engine benchmark).

    python3 tap_cost_job.py LAYERS ROUNDS OUT.json      # on the device, PYTHONPATH=$HOME/site:$REPO
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import divergence_probe as dp
from divergence_probe import modelzoo as z


def main(layers: int, rounds: int, out: Path) -> None:
    model = Path(tempfile.mkdtemp()) / "m"
    model.mkdir()
    cfg = z.make_config(arch="qwen3_moe", preset="qwen3-30b-a3b", num_layers=layers)
    z.build_tokenizer(model_max_length=cfg.max_position_embeddings).save_pretrained(model)
    with torch.device("cuda"):
        z._random_model(cfg, 0).save_pretrained(model, max_shard_size="1000GB")
    probe = dp.load(str(model), infer="vllm", dtype="bfloat16", device="cuda")
    prompts = {"num_prompts": 16, "max_prompt_tokens": 512}
    times: dict[str, list[float]] = {"all": [], "none": []}
    for r in range(rounds):
        for taps in ("all", "none") if r % 2 == 0 else ("none", "all"):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run = probe.compare(taps=taps, **prompts)
            torch.cuda.synchronize()
            times[taps].append(time.perf_counter() - start)
            del run
    probe.close()
    kept = {k: v[1:] for k, v in times.items()}
    per_round = [a / n for a, n in zip(kept["all"], kept["none"])]
    result = {"layers": layers, "rounds": rounds, "prompts": prompts, "engine": "eager", "times_s": times,
              "ratio_median_of_rounds": round(statistics.median(per_round), 3),
              "ratio_of_medians": round(statistics.median(kept["all"]) / statistics.median(kept["none"]), 3),
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
