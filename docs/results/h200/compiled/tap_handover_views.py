"""What handing a compiled engine's stacked taps over as views of its tap buffers saves, against one copy per prompt
(what stacks/vllm/stack.py `_Step.split` did before: the views are valid until the engine's next step, base.TapSink).

    .venv/bin/python docs/results/h200/compiled/tap_handover_views.py     # about three minutes on the CPU

One compiled engine with tap points (`taps="all"`, `make_model`'s tiny preset, CPU, BF16) runs
`compare --taps all` on two workloads, `short` (the first 16 shipped prompts) and `long` (64 prompts of 1024 tokens,
h200.long_prompts), alternately with the hand-over as it is (`views`) and with a per-prompt copy of each stacked
hand-over (`copies`), one call of each per round, in an order alternated each round. Reported: the median of each, and
the median of the rounds' ratios views / copies. The GPU run of the same change is in
docs/results/h200/compiled/README.md. The parent writes its section of docs/benchmarks.md and
docs/tap_handover_views.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from divergence_probe.taps import TapKey

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))  # what follows lives in benchmarks/
from docs_section import write_section
from h200 import long_prompts

WORKLOADS = ("short", "long")


def _copying(split):
    """`split` with every stacked hand-over copied out per prompt, as before the views."""

    def copying(step, x, emit, tap):
        def copy_out(prompt_id, tap, rows):
            emit(prompt_id, tap, rows.clone(memory_format=torch.contiguous_format))

        split(step, x, emit if isinstance(tap, TapKey) else copy_out, tap)

    return copying


def measure(rounds: int, models: Path) -> dict:
    import divergence_probe as dp
    from divergence_probe.modelzoo import make_model
    from divergence_probe.prompts import default_prompts_path
    from divergence_probe.stacks.vllm import stack as vllm

    if not (models / "config.json").exists():
        make_model(models, preset="tiny", seed=0)
    probe = dp.load(str(models), device="cpu", engine="compiled", taps="all")
    options = {"short": dict(prompts=default_prompts_path(), num_prompts=16, max_prompt_tokens=1024),
               "long": dict(prompts=long_prompts(probe.tokenizer, probe.settings.max_model_len, 64, 1024,
                                                 models.parent / "handover-long.jsonl"), max_prompt_tokens=1024)}
    splits = {"views": vllm._Step.split, "copies": _copying(vllm._Step.split)}
    results = {}
    try:
        for name in WORKLOADS:
            seconds = {label: [] for label in splits}
            for split in splits.values():  # warm-up: the reduction compiles for each layout
                vllm._Step.split = split
                probe.compare(taps="all", **options[name])
            for r in range(rounds):
                for label in list(splits)[:: 1 if r % 2 else -1]:
                    vllm._Step.split = splits[label]
                    start = time.perf_counter()
                    probe.compare(taps="all", **options[name])
                    seconds[label].append(time.perf_counter() - start)
            results[name] = {"seconds": seconds,
                             "median_s": {label: statistics.median(s) for label, s in seconds.items()},
                             "views_over_copies_round_median": statistics.median(
                                 v / c for v, c in zip(seconds["views"], seconds["copies"]))}
    finally:
        vllm._Step.split = splits["views"]
    return {"rounds": rounds, "torch": torch.__version__, "workloads": results}


def section(results: dict) -> str:
    rows = "\n".join(f"| {name} | {r['median_s']['copies']:.3f} s | {r['median_s']['views']:.3f} s | "
                     f"{r['median_s']['views'] / r['median_s']['copies']:.2f}x | "
                     f"{r['views_over_copies_round_median']:.2f}x |" for name, r in results["workloads"].items())
    return f"""## A compiled engine's stacked taps handed over as views, not copies (`docs/results/h200/compiled/tap_handover_views.py`)
`compare --taps all` on a compiled engine with tap points (`make_model`'s tiny preset: 4 layers, hidden 128; CPU, BF16,
torch {results['torch']}),
{results['rounds']} rounds, each one call with per-prompt copies of the stacked hand-overs (as before) and one with
views of the step's tap buffers (as now):

| workload | copies (median) | views (median) | views / copies | per-round median |
|---|---|---|---|---|
{rows}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/dp-models"))
    args = ap.parse_args()
    results = measure(args.rounds, args.models_dir / "tiny")
    write_section("tap_handover_views", section(results), results)
    print(section(results))


if __name__ == "__main__":
    main()
