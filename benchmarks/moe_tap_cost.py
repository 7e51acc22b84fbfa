"""What taps cost a MoE compare (target: taps all <= 1.3x taps none), as a ratio in one run: the command behind
docs/results/h200/moe/tap-cost/.

One load of both stacks (the Qwen3-30B-A3B layer shape cut to LAYERS layers, random weights built on the device),
then ROUNDS rounds of the same compare with `--taps all` and with `--taps none`, in an order that alternates each
round (so a slow spell hits both alike); the first round is a warm-up and is left out. The ratio is the median of the
per-round ratios, beside the ratio of the medians. The eager engine (the compiled one builds its tap points into the
engine, so its taps-none run would not be an untapped engine; benchmarks/bench_compiled_taps.py is the
compiled-engine benchmark).

    python3 benchmarks/moe_tap_cost.py 8 7 OUT.json                             # the page's run, on one H200
    python3 benchmarks/moe_tap_cost.py 1 2 /tmp/t.json --preset tiny --device cpu   # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main(layers: int, rounds: int, out: Path, preset: str, device: str) -> None:
    import torch

    import divergence_probe as dp
    from divergence_probe.models import modelzoo as z

    model = Path(tempfile.mkdtemp()) / "m"
    model.mkdir()
    cfg = z.make_config(arch="qwen3_moe", preset=preset, num_layers=layers)
    z.build_tokenizer(model_max_length=cfg.max_position_embeddings).save_pretrained(model)
    with torch.device(device):
        z._random_model(cfg, 0).save_pretrained(model, max_shard_size="1000GB")
    probe = dp.load(str(model), infer="vllm", dtype="bfloat16", device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    prompts = {"num_prompts": 16, "max_prompt_tokens": 512}
    times: dict[str, list[float]] = {"all": [], "none": []}
    for r in range(rounds):
        for taps in ("all", "none") if r % 2 == 0 else ("none", "all"):
            sync()
            start = time.perf_counter()
            run = probe.compare(taps=taps, **prompts)
            sync()
            times[taps].append(time.perf_counter() - start)
            del run
    probe.close()
    kept = {k: v[1:] for k, v in times.items()}
    per_round = [a / n for a, n in zip(kept["all"], kept["none"])]
    result = {"layers": layers, "rounds": rounds, "preset": preset, "prompts": prompts, "engine": "eager",
              "times_s": times, "ratio_median_of_rounds": round(statistics.median(per_round), 3),
              "ratio_of_medians": round(statistics.median(kept["all"]) / statistics.median(kept["none"]), 3),
              "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Time compare --taps all against --taps none on a MoE, one load.")
    parser.add_argument("layers", type=int, help="decoder layers of the cut model")
    parser.add_argument("rounds", type=int, help="rounds of both compares, the first left out (at least 2)")
    parser.add_argument("out", type=Path, help="the JSON file of times and ratios")
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="modelzoo preset of the layer shape")
    parser.add_argument("--device", default="cuda", help="cuda (the page's run) or cpu")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("rounds must be at least 2: the first is a warm-up and is left out")
    return args


if __name__ == "__main__":
    a = parse()
    main(a.layers, a.rounds, a.out, a.preset, a.device)
