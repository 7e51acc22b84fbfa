"""The GPU lane of the deployment knobs: ablate FP8 KV, FP8 weights, the trainer's Liger kernels and RMSNorm, and compare
with the engine's own kernels in the trainer, at the Qwen2.5-1.5B shape on one CUDA GPU. One part per process (one
engine per process, each part well under six minutes at the defaults):

    PYTHONPATH=$HOME/site:$PWD python3 benchmarks/h200_knobs.py --part kernels --out $OUT/knobs
    ... --part kv | weights | liger

Parts, each writing run folders under --out/PART/ and --out/PART/timings.json:
  kernels   compare as shipped and with --train-kernels vllm (the same engine, the trainer loaded twice), both with
            every tap and the noise floor: how much of the gap is left once the trainer runs the engine's kernels.
  kv        ablate --regions rmsnorm --factor engine:kv_cache_dtype=fp8 (taps none, noise floors).
  weights   ablate --regions rmsnorm --factor engine:quantization=fp8 (needs compressed-tensors on the device).
  liger     ablate --regions lm_head --factor train:kernels=liger (liger replaces RMSNorm in the trainer, so its
            partner region is one it leaves alone; needs liger-kernel on the device).
  moe       ablate --regions routing --factor engine:kv_cache_dtype=fp8 at the Qwen3-30B-A3B layer shape, 8 layers
            (--moe-preset, --moe-layers): routing replay beside the FP8 KV cache on a mixture-of-experts model;
            moe-weights and moe-liger the same beside FP8 weights and beside Liger in the trainer.
The engine is eager (every tap); an engine factor builds its second engine in a worker process, so both engines get
--gpu-memory-utilization. The checkpoint is the project's random-weight build of the preset's shape (make-model).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import divergence_probe as dp
from divergence_probe.models.modelzoo import make_model

FACTORS = {"kv": ("rmsnorm", "engine:kv_cache_dtype=fp8"), "weights": ("rmsnorm", "engine:quantization=fp8"),
           "liger": ("lm_head", "train:kernels=liger"), "moe": ("routing", "engine:kv_cache_dtype=fp8"),
           "moe-weights": ("routing", "engine:quantization=fp8"), "moe-liger": ("routing", "train:kernels=liger")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["kernels", *FACTORS], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="qwen2.5-1.5b")
    parser.add_argument("--moe-preset", default="qwen3-30b-a3b")
    parser.add_argument("--moe-layers", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    parser.add_argument("--bootstrap", type=int, default=200)
    args = parser.parse_args()
    out = args.out / args.part
    out.mkdir(parents=True, exist_ok=True)
    preset, layers = (args.moe_preset, args.moe_layers) if args.part.startswith("moe") else (args.preset, None)
    timings: dict[str, object] = {"part": args.part, "preset": preset, "layers": layers, "engine": "eager",
                                  "commit": os.environ.get("DP_COMMIT", "unknown")}
    start = time.perf_counter()
    model = Path("/tmp/dp-models") / f"{preset}-{layers or 'all'}"  # one build serves every part of the preset
    if not model.exists():
        make_model(model, preset=preset, seed=0, num_layers=layers)
    timings["make_model_s"] = time.perf_counter() - start
    engine_args = {"gpu_memory_utilization": args.gpu_memory_utilization}
    opts = dict(num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)
    start = time.perf_counter()
    probe = dp.load(str(model), device="cuda", dtype="bfloat16", engine="eager", engine_args=engine_args,
                    taps="all" if args.part == "kernels" else "none")
    timings["load_s"] = time.perf_counter() - start
    try:
        if args.part == "kernels":
            for name in ("shipped", "train-kernels-vllm"):  # one trainer at a time: the second is loaded after
                view = probe if name == "shipped" else probe.with_trainer(train_kernels="vllm")
                start = time.perf_counter()
                run = view.compare(taps="all", batch_invariance=True, **opts)
                timings[f"{name}_s"] = time.perf_counter() - start
                run.write(out / name)
                timings[f"{name}_summary"] = run.summary
                if view is not probe:
                    view.close()
        else:
            region, factor = FACTORS[args.part]
            start = time.perf_counter()
            run = probe.ablate(regions=region, factor=[factor], taps="none", batch_invariance=True,
                               bootstrap=args.bootstrap, **opts)
            timings["ablate_s"] = time.perf_counter() - start
            run.write(out / "ablate")
            timings["attribution"] = run.attribution_table.to_dict("records")
    finally:
        probe.close()
    import torch
    import vllm

    timings |= {"gpu": torch.cuda.get_device_name(), "vllm": vllm.__version__, "torch": torch.__version__}
    (out / "timings.json").write_text(json.dumps(timings, indent=2, default=str) + "\n")
    print(json.dumps(timings, indent=2, default=str))


if __name__ == "__main__":
    main()
