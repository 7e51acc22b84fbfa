"""Check a Qwen3-MoE compare run's routing.csv `frac_experts_differ`, per layer, against the experts each stack ran,
read here without the tool's routing code (numerics/routing.py, runs/route_capture.py).

    python benchmarks/routing_ids_check.py RUN_FOLDER            # a prefill-mode `divergence-probe compare` run

The sequences are the run's own (prompts.jsonl token ids); the checkpoint, dtype, device and engine settings are its
manifest's.
- Trainer: a fresh transformers load of the checkpoint, SDPA attention, under the trainer's torch numerics
  (torch_state.trainer_numerics, which the run's trainer ran under), each sequence alone as compare's trainer runs
  it; a forward hook on every layer's router (`mlp.gate`, Qwen3MoeTopKRouter) keeps its third output, the ids.
- Engine on a GPU: a fresh `vllm.LLM` with `enable_return_routed_experts=True` and the run's --batch-tokens, every
  sequence in one generate call (one new token each), and the `routed_experts` ([tokens, layers, k]) vLLM returns.
- Engine on the CPU: vLLM's CPU worker does not fill `routed_experts`, so the ids come from the tool's vLLM stack, its
  `expert_ids` record (the ids its router's select_experts returned), scored batched as compare scores them: an
  independent count of the ids, but through the tool's capture.
Prints per layer the tool's frac_experts_differ, the recount and their difference; exits 1 if any layer differs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import pandas as pd
import torch


def _sequences(run: Path) -> dict[int, list[int]]:
    return {r["prompt_id"]: r["token_ids"] for r in map(json.loads, (run / "prompts.jsonl").read_text().splitlines())
            if r}


def trainer_ids(model: str, dtype: torch.dtype, device: str, sequences: dict) -> dict[tuple[int, int], torch.Tensor]:
    """(prompt, layer) -> the ids transformers' router returned, each sequence alone."""
    from transformers import AutoModelForCausalLM

    from divergence_probe.engines.torch_state import trainer_numerics

    ids, running = {}, []
    with trainer_numerics():
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        for i, layer in enumerate(hf.model.layers):
            layer.mlp.gate.register_forward_hook(
                lambda m, args, out, i=i: ids.__setitem__((running[-1], i), out[2].cpu()))
        with torch.inference_mode():
            for pid, tokens in sequences.items():
                running.append(pid)
                hf(torch.tensor([tokens], device=device))
    return ids


def engine_ids_gpu(model: str, load: dict, sequences: dict) -> dict[tuple[int, int], torch.Tensor]:
    """(prompt, layer) -> the experts vLLM records it routed each prompt token to (enable_return_routed_experts)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from divergence_probe.engines.vllm.engine_start import _disable_flashinfer_sampler_if_missing

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process, as the tool's engine runs, so that
    _disable_flashinfer_sampler_if_missing()  # this reaches it: vLLM's CUDA sampler imports flashinfer unguarded
    llm = LLM(model, dtype=load["dtype"], seed=load["seed"], enforce_eager=load["engine"] == "eager",
              max_num_batched_tokens=load["batch_tokens"], enable_return_routed_experts=True,
              enable_prefix_caching=False, gpu_memory_utilization=0.85,  # this process's CUDA context stays
              **load.get("engine_args", {}))
    pids = list(sequences)
    outs = llm.generate([TokensPrompt(prompt_token_ids=sequences[p]) for p in pids], SamplingParams(max_tokens=1))
    ids = {}
    for pid, out in zip(pids, outs):
        routed = torch.as_tensor(out.outputs[0].routed_experts)[: len(sequences[pid])]  # [tokens, layers, k]
        for layer in range(routed.shape[1]):
            ids[(pid, layer)] = routed[:, layer]
    return ids


def engine_ids_cpu(model: str, load: dict, sequences: dict) -> dict[tuple[int, int], torch.Tensor]:
    """(prompt, layer) -> the ids the tool's vLLM stack records its router returned (the CPU has no routed_experts)."""
    import divergence_probe as dp
    from divergence_probe.prompts import Prompt

    prompts = [Prompt(pid, "", "", tuple(tokens)) for pid, tokens in sequences.items()]
    ids = {}
    with dp.load(model, **{k: load[k] for k in ("infer", "dtype", "device", "engine", "batch_tokens", "seed")}) as probe:
        probe.infer.score_batched(prompts, frozenset({"expert_ids"}),
                                  lambda pid, key, x: ids.__setitem__((pid, key.layer), x.cpu().clone()))
    return ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    run = parser.parse_args().run
    manifest = json.loads((run / "manifest.json").read_text())
    load = manifest["spec"]["load"]
    if manifest["spec"].get("generate", {}).get("mode", "prefill") != "prefill":
        print("routing_ids_check: a generate-mode run's sampled tokens are not in prompts.jsonl; check a prefill run")
        return 2
    model, sequences = manifest["model"]["path"], _sequences(run)
    train = trainer_ids(model, getattr(torch, load["dtype"]), load["device"], sequences)
    gc.collect()  # the trainer's weights go before the engine asks for its share of the device
    if load["device"].startswith("cuda"):
        torch.cuda.empty_cache()
    engine = (engine_ids_gpu if load["device"].startswith("cuda") else engine_ids_cpu)(model, load, sequences)
    table = pd.read_csv(run / "routing.csv").sort_values("layer")
    worst = 0  # token-layers: the tool's fraction times the tokens is a count, so the two must agree exactly
    print(f"{'layer':>5} {'tokens':>7} {'tool frac_experts_differ':>25} {'independent':>12} {'count difference':>17}")
    for row in table.itertuples():
        a = torch.cat([engine[(p, row.layer)].long().sort(-1).values for p in sequences])
        b = torch.cat([train[(p, row.layer)].long().sort(-1).values for p in sequences])
        differ = int((a != b).any(-1).sum())
        tool = round(row.frac_experts_differ * row.tokens)
        worst = max(worst, abs(differ - tool))
        print(f"{row.layer:>5} {row.tokens:>7} {row.frac_experts_differ:>25.6f} {differ / len(a):>12.6f} "
              f"{differ - tool:>17}")
    print("agree" if worst == 0 else f"differ: up to {worst} token-layers in a layer")
    return 0 if worst == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
