"""The memory plan against what a run holds, per stack, over model sizes: predicted vs measured.

    .venv/bin/python benchmarks/memory_plan.py                       # CPU: tiny shapes, a few minutes on 2 cores
    .venv/bin/python benchmarks/memory_plan.py --presets tiny --infer hf --out /tmp/m.json   # the CI smoke size
    PYTHONPATH=$HOME/site:$PWD python3 benchmarks/memory_plan.py --device cuda --models /m/qwen2.5-7b,/m/qwen2.5-14b \
        --num-prompts 32 --max-prompt-tokens 1024 --out $OUT/memory_plan_h200.json

What is measured, and how honest each number is:
- the tap bytes of the largest inference batch and of the longest training sequence, counted by a capture that
  files every hand-over (runs/measured.py CountingCapture): the bytes of the tensors handed over, which the plan's
  infer_taps/train_taps terms must equal exactly, and of the distinct storages behind them (a view keeps its whole
  buffer: what the device really holds for the taps);
- each stack's weights: the distinct storages of transformers' parameters; vLLM's own report on CUDA
  (model_memory_usage; its CPU build repacks the weights outside the module, where nothing here can count them);
- on CUDA, the allocator's peak per phase of the run loop (runs/measured.py Peaks: both stacks share this process's
  allocator) against the plan's phases. On the CPU there is no honest peak per stack (RSS mixes both stacks, the
  libraries and glibc's heap): the process's ru_maxrss is reported beside the plan's total, for scale only.

Each model runs in a child process (`--child`): vLLM's CPU backend hosts one engine per process. The results go to
docs/benchmarks/memory_plan.json (or --out); docs/benchmarks.md has the section that reads them.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "memory_plan.json"
# preset:layers (None: the preset's depth). CPU sizes: the tiny shape at three depths, and the 0.5B shape's widths
# (its vocabulary and MLP) cut to two layers.
CPU_PRESETS = ("tiny:2", "tiny", "tiny:8", "qwen2.5-0.5b:2")


def child(model: str, infer: str, device: str, prompts: str | None, num_prompts: int | None,
          max_prompt_tokens: int | None) -> dict:
    import torch

    import divergence_probe as dp
    from divergence_probe.runs.capture import TapPairing
    from divergence_probe.runs.compare import SequenceSource, score_both
    from divergence_probe.runs.loading import load_run_prompts
    from divergence_probe.runs.measured import CountingCapture, Peaks, engine_report
    from divergence_probe.spec import spec_from_flat
    from divergence_probe.taps import expected_taps

    flat = {"model": model, "infer": infer, "device": device, "taps": "all"}
    if prompts:
        flat["prompts"] = prompts
    if num_prompts:
        flat["num_prompts"] = num_prompts
    if max_prompt_tokens:
        flat["max_prompt_tokens"] = max_prompt_tokens
    spec = spec_from_flat("compare", **flat)
    probe = dp.load(spec=spec.load, taps=spec.capture.taps, plan_for=spec)
    plan = probe.memory_plan
    _, run_prompts = load_run_prompts(spec, probe.tokenizer, probe.settings.max_model_len)
    taps = spec.capture.tap_names
    pairing = TapPairing(expected_taps(taps, probe.source.num_layers, probe.source.family.layer_taps))
    pairing.chunk_elements = plan.reduction_chunk_elements
    counting = CountingCapture(pairing)
    peaks = Peaks(probe.settings.device)
    if probe.settings.device == "cuda":
        torch.cuda.synchronize()
    score_both(probe, run_prompts, SequenceSource(), taps, taps, counting, lambda scores: scores.read(), peaks)

    def weights(module) -> int:
        return sum({p.data_ptr(): p.nbytes for p in module.state_dict().values()}.values())

    engine = engine_report(probe.infer)
    # vLLM's CPU build repacks its linear weights for oneDNN outside the module's state_dict, so only its own report
    # (CUDA: model_memory_usage) measures them; a transformers inference side is measured like the training side
    infer_weights = weights(probe.infer.model) if infer == "hf" else engine.get("weights_bytes")
    measured = counting.largest() | {"train_weights": weights(probe.train.model), "infer_weights": infer_weights}
    if engine:
        measured["engine"] = engine
    if probe.settings.device == "cuda":
        measured["peaks"] = peaks.record()
    else:
        measured["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    predicted = dict(plan.terms) | {"phases": dict(plan.phases), "needed": plan.needed}
    return {"model": model, "parameters": plan.inputs.model.parameters, "layers": plan.inputs.model.layers,
            "hidden": plan.inputs.model.hidden, "vocab": plan.inputs.model.vocab, "infer": infer,
            "device": probe.settings.device, "batch_tokens": plan.batch_tokens,
            "reduction_chunk_elements": plan.reduction_chunk_elements, "prompts": plan.inputs.record()["prompt_lengths"],
            "predicted": predicted, "measured": measured}


def build(preset_spec: str, where: Path) -> str:
    from divergence_probe.models.modelzoo import make_model

    preset, _, layers = preset_spec.partition(":")
    path = where / preset_spec.replace(":", "-L")
    make_model(path, preset=preset, arch="qwen2" if preset.startswith("qwen2") else "qwen3", seed=0,
               num_layers=int(layers) if layers else None)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(CPU_PRESETS), help="modelzoo preset[:layers], comma separated")
    parser.add_argument("--models", default="", help="checkpoint folders instead of presets (e.g. on the GPU)")
    parser.add_argument("--infer", default="vllm")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", default=None, help="default: the built-in sample prompts")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-prompt-tokens", type=int, default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.infer, args.device, args.prompts, args.num_prompts,
                               args.max_prompt_tokens)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = [m for m in args.models.split(",") if m] or [build(p, Path(tmp)) for p in args.presets.split(",") if p]
        for model in models:
            cmd = [sys.executable, __file__, "--child", model, "--infer", args.infer, "--device", args.device]
            if args.prompts:
                cmd += ["--prompts", args.prompts]
            if args.num_prompts:
                cmd += ["--num-prompts", str(args.num_prompts)]
            if args.max_prompt_tokens:
                cmd += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                sys.exit(f"{model}: child failed\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["model"] = Path(model).name
            rows.append(row)
            p, m = row["predicted"], row["measured"]
            print(f"{row['model']:>20} params {row['parameters'] / 1e6:8.1f}M  infer taps plan {p['infer_taps'] / 2**20:8.1f}"
                  f" MiB handed {m['infer_taps_handed_over'] / 2**20:8.1f} held {m['infer_taps_storage'] / 2**20:8.1f}"
                  f"  train taps plan {p['train_taps'] / 2**20:7.1f} held {m['train_taps_storage'] / 2**20:7.1f}"
                  f"  weights plan {p['train_weights'] / 2**20:7.1f} measured {m['train_weights'] / 2**20:7.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": args.device, "infer": args.infer, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
