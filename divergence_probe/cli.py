"""The `divergence-probe` command: a thin typer shell over the Python API (parse -> API -> rich).

Errors a user can fix (ProbeError) become one red line and exit code 2; anything else is a bug and keeps
its traceback. Set DP_RAISE_ERRORS=1 to get tracebacks for ProbeErrors too.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import ProbeError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Find where vLLM and the transformers training stack round differently, layer by layer and token by token.",
)
console = Console(stderr=True)
out = Console()

ModelOpt = typer.Option(None, "--model", "-m", help="Checkpoint folder or hub id (e.g. Qwen/Qwen2.5-1.5B). Default: the built-in tiny Qwen3 model.")
PromptsOpt = typer.Option(None, "--prompts", "-p", help=".txt (blank-line or --- separated), .jsonl (prompt or chat messages), or a folder of them. Default: sample_prompts/.")
NumPromptsOpt = typer.Option(None, "--num-prompts", "-n", help="Use only the first N prompts.")
MaxTokOpt = typer.Option(None, "--max-prompt-tokens", help="Truncate prompts to N tokens (otherwise a prompt longer than the context is an error).")
DtypeOpt = typer.Option("bfloat16", "--dtype", help="bfloat16, float16 or float32; both stacks use it.")
InferOpt = typer.Option("vllm", "--infer", help="Inference side: vllm, or hf (a second transformers instance: the zero baseline).")
AttnOpt = typer.Option("sdpa", "--train-attn", help="transformers attention on the training side: sdpa, eager or flash_attention_2.")
TapsOpt = typer.Option("all", "--taps", help="all, none, or a comma list of tap names (embed, input_norm, q_norm, k_norm, q_rope, k_rope, attn_core, attn_out, resid_mid, post_norm, swiglu, mlp_out, resid_out, final_norm, logits).")
DeviceOpt = typer.Option("auto", "--device", help="auto (cuda when present), cpu or cuda.")
SeedOpt = typer.Option(0, "--seed", help="Seed for every random choice (recorded in the manifest).")
ThresholdOpt = typer.Option(1e-3, "--threshold", help="rel_l2 above which a tap counts as diverged (first_over_threshold).")
BatchOpt = typer.Option(8192, "--batch-tokens", help="Most prompt tokens per inference batch; bounds the memory held while pairing taps.")
OutOpt = typer.Option(None, "--out", "-o", help="New or empty output folder. Default: runs/<timestamp>.")


def _default_out() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def _fail(error: ProbeError) -> None:
    if os.environ.get("DP_RAISE_ERRORS"):
        raise error
    console.print(f"[bold red]error:[/] {error}", highlight=False, markup=True)
    raise typer.Exit(error.exit_code)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)


def _print_summary(run, out_dir: Path) -> None:
    from .reports.tables import worst_layer

    s = run.summary
    table = Table(title="vLLM vs transformers" if run.manifest["load"]["infer"] == "vllm" else "infer vs train", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("tokens scored", str(s["n_tokens"]))
    table.add_row("mean |Δlogp|", f"{s['mean_abs_dlogp']:.3e}")
    table.add_row("max |Δlogp|", f"{s['max_abs_dlogp']:.3e}")
    table.add_row("p99 |Δlogp|", f"{s['p99_abs_dlogp']:.3e}")
    table.add_row("mean KL(infer‖train)", f"{s['mean_kl']:.3e}")
    table.add_row("max KL", f"{s['max_kl']:.3e}")
    table.add_row("first inexact tap", s["first_inexact"])
    table.add_row(f"first tap over rel_l2 {run.threshold:g}", s["first_over_threshold"])
    worst = worst_layer(run.tap_stats)
    table.add_row("worst layer (resid_out rel_l2)", f"{worst[0]} ({worst[1]:.3e})" if worst else "not captured")
    out.print(table)
    out.print(f"report: {out_dir}")


@app.command()
def compare(
    model: Optional[str] = ModelOpt,
    prompts: Optional[Path] = PromptsOpt,
    num_prompts: Optional[int] = NumPromptsOpt,
    max_prompt_tokens: Optional[int] = MaxTokOpt,
    dtype: str = DtypeOpt,
    infer: str = InferOpt,
    train_attn: str = AttnOpt,
    taps: str = TapsOpt,
    device: str = DeviceOpt,
    seed: int = SeedOpt,
    threshold: float = ThresholdOpt,
    batch_tokens: int = BatchOpt,
    out_dir: Optional[Path] = OutOpt,
) -> None:
    """Load the same weights in vLLM and transformers, feed both the same token ids, and diff every tap of
    every decoder layer and every token's logprob.

    Writes manifest.json, prompts.jsonl, tokens.csv, layers.csv and summary.csv (see README for columns).
    """
    import divergence_probe as dp
    from .compare import CompareOptions
    from .reports.writer import check_out_dir

    try:
        out_dir = out_dir or _default_out()
        check_out_dir(out_dir)
        load_kwargs = dict(infer=infer, dtype=dtype, device=device, train_attn=train_attn, seed=seed, batch_tokens=batch_tokens)
        dp.LoadConfig(model=model, **load_kwargs)  # validate flags before the slow load
        CompareOptions(threshold=threshold, taps=taps)
        with console.status("loading the model in transformers and the inference stack…"):
            probe = dp.load(model, **load_kwargs)
        with _progress() as bar:
            task = bar.add_task("comparing prompts", total=None)
            run = probe.compare(
                prompts=prompts, num_prompts=num_prompts, max_prompt_tokens=max_prompt_tokens, taps=taps,
                threshold=threshold, progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
        run.manifest["command"] = sys.argv
        run.write(out_dir)
    except ProbeError as e:
        _fail(e)
    _print_summary(run, out_dir)


@app.command("make-model")
def make_model(
    out_dir: Path = typer.Argument(..., help="New folder for the checkpoint."),
    arch: Optional[str] = typer.Option(None, "--arch", help="qwen2 or qwen3; default: the preset's own (tiny: qwen3)."),
    preset: str = typer.Option("tiny", "--preset", help="tiny (a few MB), qwen2.5-0.5b, qwen2.5-1.5b, qwen3-0.6b or qwen3-1.7b (real shapes, random weights)."),
    seed: int = typer.Option(0, "--seed", help="Weight seed; same seed, same bytes."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing non-empty folder."),
) -> None:
    """Write a Hugging Face-format Qwen checkpoint with seeded random weights and a real BPE tokenizer.

    Real weights need a network; these models let you run everything offline, at real shapes.
    """
    from .modelzoo import make_model as build

    try:
        with console.status(f"building {arch} {preset}…"):
            path = build(out_dir, arch=arch, preset=preset, seed=seed, overwrite=overwrite)
    except ProbeError as e:
        _fail(e)
    out.print(f"model: {path}")


def main() -> None:
    app()
