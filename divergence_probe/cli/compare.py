"""`compare` and `ablate`: a RunSpec from the flags (every option one of its fields: options.run_flags), run by the
API (divergence_probe.run), its summary on stdout."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .console import say
from .options import PANELS, command_doc, fail_if_parameter, generated, out_parameter, parameters, run_flags
from .runner import closing, exit_by, gate_of, next_step, run_spec
from .tables import print_ablation, print_summary

COMPARE_DOC = command_doc("""Load the same weights in vLLM and transformers, feed both the same token ids, and diff every tap of
    every decoder layer and every token's logprob.

    Writes manifest.json, prompts.jsonl, tokens.csv, layers.csv and summary.csv (columns: docs/reference/outputs.md,
    "Output files"). Without --model, the built-in model and the packaged sample prompts: it runs offline.

    Examples:
      divergence-probe compare --batch-invariance --report
      divergence-probe compare --model Qwen/Qwen2.5-1.5B --taps all
      divergence-probe compare --model M --engine compiled --engine-noise
      divergence-probe compare --model M --graft --depth
      divergence-probe compare --model M --mode generate --prompts my.jsonl
    """)
ABLATE_DOC = command_doc("""Rerun compare with every combination of aligned regions (RoPE, SwiGLU, residual RMSNorm) and attribute
    the vLLM-vs-transformers mismatch to regions with Shapley values and bootstrap intervals.

    Writes compare's files with a combo column, plus ablation.csv (one row per combination) and
    attribution.csv (one row per region and one for all regions together: each its change of the
    metric as a signed share of the shipped value).

    Examples:
      divergence-probe ablate --taps none
      divergence-probe ablate --model M --taps none --side train --out runs/fix
      divergence-probe ablate --model M --regions rope,swiglu,rmsnorm,lm_head
      divergence-probe ablate --model M --regions rope,rmsnorm,routing
    """)


REMEDIES_DOC = command_doc("""Try each candidate remedy (aligned regions, FP16, the trainer's most divergent layers in
    FP32, trainer kernels, AMP, FP8 off, MoE routing replay) against the stacks as shipped on the same prompts, and
    rank what removes a detectable part of the mismatch by effect and by what it costs each side.

    Writes remedies.csv (one row per arm, run or not and why: its change with a paired bootstrap interval, its noise
    floor, what it needs, the time and peak memory it adds to the trainer's forward, forward+backward and the engine's
    step) and compare's files with a combo column per arm.

    Examples:
      divergence-probe remedies
      divergence-probe remedies --model M --num-prompts 40 --out runs/remedies
      divergence-probe remedies --model M --arms aligned_trainer,fp32_layers,fp16 --fp32-layers 4
    """)


def spec_command(kind: str, doc: str):
    """The typer command of `kind` (compare, ablate or remedies): its options are the spec's fields; it builds the
    RunSpec, runs it, writes it and shows its summary (remedies: its ranking in words)."""
    after = {"ablate": print_ablation, "remedies": lambda run: [say(line) for line in run.lines()]}.get(
        kind, print_summary)

    def command(out_dir: Optional[Path] = None, fail_if: Optional[list[str]] = None, **flags) -> None:
        from ..spec.run import spec_from_flat

        gate = gate_of(fail_if, kind)
        run, out_dir, verdict = run_spec(lambda: spec_from_flat(kind, **flags), out_dir, gate=gate)
        after(run)
        closing(out_dir, run.spec.report, next_step(run))
        exit_by(verdict)

    params = [*parameters(run_flags(kind)), out_parameter(PANELS[None]), fail_if_parameter(PANELS[None])]
    return generated(command, params, doc, kind)


def compare_command():
    return spec_command("compare", COMPARE_DOC)


def ablate_command():
    return spec_command("ablate", ABLATE_DOC)


def remedies_command():
    return spec_command("remedies", REMEDIES_DOC)
