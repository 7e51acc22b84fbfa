"""Which aligned regions change a compiled engine at all: each region set's engine against the shipped one, bitwise.

    .venv/bin/python docs/design/compiled_region_effect.py [--regions rope,swiglu,rmsnorm] [--engine compiled]

Builds the shipped engine and one engine per single region and for all of them together, each in its own worker
process (`divergence_probe.stacks.vllm.worker.WorkerStack`, regions patched before the engine compiles), scores
the same prompts (token ids 5..39 and 100..119 of the tiny Qwen3, or --num-prompts shipped sample prompts) and
prints whether the logits are bitwise equal to the shipped engine's and the largest logit difference.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--regions", default="rope,swiglu,rmsnorm")
    ap.add_argument("--engine", default="compiled")
    ap.add_argument("--num-prompts", type=int, default=4)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from divergence_probe.modelzoo import make_model
    from divergence_probe.prompts import default_prompts_path, load_prompts
    from divergence_probe.stacks.base import StackSettings
    from divergence_probe.stacks.vllm.worker import WorkerStack

    tmp = Path(tempfile.mkdtemp(prefix="region-effect-"))
    model = make_model(tmp / "m", arch="qwen3", preset="tiny", seed=0)
    prompts = load_prompts(default_prompts_path(), AutoTokenizer.from_pretrained(model), num_prompts=args.num_prompts,
                           max_prompt_tokens=128, max_model_len=512)
    settings = StackSettings(model_path=str(model), dtype=torch.bfloat16, device="cpu", max_model_len=512,
                             engine=args.engine)
    names = [r for r in args.regions.split(",") if r]
    sets = [(), *[(r,) for r in names], tuple(names)] if len(names) > 1 else [(), tuple(names)]
    logits = {}
    for regions in sets:
        with WorkerStack(settings, regions) as worker:
            worker.load(settings)
            logits[regions] = [s.logits for s in worker.score_batched(prompts)]
    print(f"| engine {args.engine}: aligned regions | logits bitwise equal to shipped | max abs logit difference |")
    print("|---|---|---:|")
    for regions in sets[1:]:
        pairs = list(zip(logits[()], logits[regions]))
        equal = all(torch.equal(a, b) for a, b in pairs)
        gap = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
        print(f"| {'+'.join(regions)} | {'yes' if equal else 'no'} | {gap:.3g} |")


if __name__ == "__main__":
    main()
