"""`make-model`: a Qwen checkpoint with seeded random weights (models/modelzoo.py), to run everything offline."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.text import Text

from ..errors import ProbeError
from .console import console, fail, out
from .options import help_from_doc


@help_from_doc
def make_model(
    out_dir: Path = typer.Argument(..., help="New folder for the checkpoint."),
    arch: Optional[str] = typer.Option(None, "--arch", help="qwen2, qwen3 or qwen3_moe; default: the preset's own (tiny: qwen3)."),
    preset: str = typer.Option("tiny", "--preset", help="tiny (a few MB; with --arch qwen3_moe: 32 experts, top-4), qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, qwen2.5-14b, qwen2.5-32b, qwen3-0.6b, qwen3-1.7b or qwen3-30b-a3b (real shapes, random weights)."),
    seed: int = typer.Option(0, "--seed", help="Weight seed; same seed and --device, same bytes."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing non-empty folder."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Number of decoder layers; default: the preset's. Cuts a real shape's depth to fit one device."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda: where the weights are drawn. cuda builds a published shape in seconds, and its generator gives other bytes than the CPU's for the same seed."),
) -> None:
    """Write a Hugging Face-format Qwen checkpoint with seeded random weights and a real BPE tokenizer.

    Real weights need a network; these models let you run everything offline, at real shapes.

    Examples:
      divergence-probe make-model models/tiny
      divergence-probe make-model models/moe --arch qwen3_moe
      divergence-probe make-model models/q7 --preset qwen2.5-7b --layers 4
      divergence-probe make-model models/a3b --preset qwen3-30b-a3b --device cuda
      divergence-probe compare --model models/q7 --device cuda
    """
    from ..models.modelzoo import make_model as build

    try:
        # a Text: the spinner would read a str as markup and emoji codes, and the preset is the user's text
        with console.status(Text(f"building {preset} ({arch})…" if arch else f"building {preset}…")):
            path = build(out_dir, arch=arch, preset=preset, seed=seed, overwrite=overwrite, num_layers=layers,
                         device=device)
    except ProbeError as e:
        fail(e)
    out.print(f"model: {path}")
