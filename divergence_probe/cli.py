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
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import ProbeError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Find where vLLM and the transformers training stack round differently, layer by layer and token by token.",
)
console = Console(stderr=True, soft_wrap=True)  # soft_wrap: an error stays one line in a pipe or CI log (no 80-column wrap)
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
ModeOpt = typer.Option("prefill", "--mode", help="prefill: score the prompts (vLLM's prompt logprobs); generate: sample responses through vLLM's decode path and compare what RL sees.")
NewTokOpt = typer.Option(64, "--max-new-tokens", help="generate mode: most tokens sampled per response.")
SamplesOpt = typer.Option(1, "--samples-per-prompt", help="generate mode: responses sampled per prompt.")
TempOpt = typer.Option(1.0, "--temperature", help="generate mode: sampling temperature (0 = greedy). Compared logprobs stay raw (untempered).")
TopPOpt = typer.Option(1.0, "--top-p", help="generate mode: nucleus sampling.")
ClipOpt = typer.Option(0.2, "--clip-eps", help="generate mode: PPO clip band [1-eps, 1+eps] for the ratio metrics.")
TisOpt = typer.Option(2.0, "--tis-cap", help="generate mode: TIS truncation cap C (token MIS band [1/C, C]).")
BatchInvOpt = typer.Option(False, "--batch-invariance", help="Also measure each stack alone vs batched on the same sequences (the noise floor; batch_invariance.csv).")
AlignOpt = typer.Option("", "--align", help="Regions to align (FP32 until the output, one rounding): comma list of rope, swiglu, rmsnorm.")
SideOpt = typer.Option("both", "--side", help="Where regions are aligned: both, train (transformers only; the engine as shipped) or infer.")
ReportOpt = typer.Option(False, "--report", help="After the run is written, render OUT/report (report.md and figures; see the report command).")


def _default_out() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def _fail(error: ProbeError) -> None:
    if os.environ.get("DP_RAISE_ERRORS"):
        raise error
    console.print(f"[bold red]error:[/] {escape(_one_line(error))}", highlight=False, markup=True)
    raise typer.Exit(error.exit_code)


def _one_line(error: BaseException) -> str:
    """Messages that quote a library's text can hold newlines; a log line must not."""
    return " ".join(str(error).split())


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)


def _print_summary(run, out_dir: Path) -> None:
    from .tables import worst_layer

    s = run.summary
    table = Table(title="vLLM vs transformers" if run.manifest["load"]["infer"] == "vllm" else "infer vs train", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("response tokens scored" if "k3" in s else "tokens scored", str(s["n_tokens"]))
    table.add_row("mean |Δlogp|", f"{s['mean_abs_dlogp']:.3e}")
    table.add_row("max |Δlogp|", f"{s['max_abs_dlogp']:.3e}")
    table.add_row("p99 |Δlogp|", f"{s['p99_abs_dlogp']:.3e}")
    table.add_row("mean KL(infer‖train)", f"{s['mean_kl']:.3e}")
    table.add_row("max KL", f"{s['max_kl']:.3e}")
    table.add_row("first inexact tap", s["first_inexact"])
    table.add_row(f"first tap over rel_l2 {run.threshold:g}", s["first_over_threshold"])
    worst = worst_layer(run.tap_stats)
    table.add_row("worst layer (resid_out rel_l2)", f"{worst[0]} ({worst[1]:.3e})" if worst else "not captured")
    for key, label in [("noise_infer_mean_abs_dlogp", "noise floor: infer alone vs batched"),
                       ("noise_train_mean_abs_dlogp", "noise floor: train alone vs batched"),
                       ("k3", "k3 KL estimate"), ("ratio_min", "min importance ratio"), ("ratio_max", "max importance ratio"),
                       ("ppo_clip_frac", "PPO-clipped fraction (numerics alone)"), ("ess", "effective sample size")]:
        if key in s:
            table.add_row(label, f"{s[key]:.3e}")
    out.print(table)
    out.print(f"run: {out_dir}")


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
    align: str = AlignOpt,
    side: str = SideOpt,
    mode: str = ModeOpt,
    max_new_tokens: int = NewTokOpt,
    samples_per_prompt: int = SamplesOpt,
    temperature: float = TempOpt,
    top_p: float = TopPOpt,
    clip_eps: float = ClipOpt,
    tis_cap: float = TisOpt,
    batch_invariance: bool = BatchInvOpt,
    report: bool = ReportOpt,
) -> None:
    """Load the same weights in vLLM and transformers, feed both the same token ids, and diff every tap of
    every decoder layer and every token's logprob.

    Writes manifest.json, prompts.jsonl, tokens.csv, layers.csv and summary.csv (see README for columns).
    """
    from .ablate import AblateOptions
    from .regions import parse_regions

    generate = _generate_options(mode, max_new_tokens, samples_per_prompt, temperature, top_p, clip_eps, tis_cap)

    def work(probe, progress):
        return probe.compare(align=parse_regions(align), side=side, generate=generate, prompts=prompts,
                             num_prompts=num_prompts, max_prompt_tokens=max_prompt_tokens, taps=taps,
                             threshold=threshold, batch_invariance=batch_invariance, progress=progress)

    def validate():
        AblateOptions(regions=parse_regions(align) or ("rope",), side=side)
        _check_generate(generate)

    run, out_dir = _run(work, validate, model, out_dir, taps, threshold,
                        dict(infer=infer, dtype=dtype, device=device, train_attn=train_attn, seed=seed,
                             batch_tokens=batch_tokens))
    _print_summary(run, out_dir)
    if report:
        _write_report(out_dir)


def _generate_options(mode, max_new_tokens, samples_per_prompt, temperature, top_p, clip_eps, tis_cap):
    """None for prefill mode, else the GenerateOptions fields (validated in _check_generate)."""
    if mode not in ("prefill", "generate"):
        return {"mode": mode}
    if mode == "prefill":
        return None
    return dict(max_new_tokens=max_new_tokens, samples_per_prompt=samples_per_prompt, temperature=temperature,
                top_p=top_p, clip_eps=clip_eps, tis_cap=tis_cap)


def _check_generate(generate) -> None:
    from .rollout import GenerateOptions

    if generate and "mode" in generate:
        raise ProbeError(f"--mode {generate['mode']!r}; choose prefill or generate")
    if generate:
        GenerateOptions(**generate)


def _run(work, validate, model, out_dir, taps, threshold, load_kwargs):
    """Shared by compare and ablate: validate every flag, check --out, load once, run with a progress bar,
    write atomically. Any ProbeError on the way is one line and exit code 2, and nothing is written."""
    import divergence_probe as dp
    from .compare import CompareOptions
    from .reports.writer import check_out_dir

    try:
        out_dir = out_dir or _default_out()
        dp.LoadConfig(model=model, **load_kwargs)  # validate flags before the slow load
        CompareOptions(threshold=threshold, taps=taps)
        validate()
        check_out_dir(out_dir)
        with console.status("loading the model in transformers and the inference stack…"):
            probe = dp.load(model, **load_kwargs)
        with _progress() as bar:
            task = bar.add_task("scoring prompts", total=None)
            run = work(probe, lambda done, total: bar.update(task, completed=done, total=total))
        run.manifest["command"] = sys.argv
        run.write(out_dir)
    except ProbeError as e:
        _fail(e)
    return run, out_dir


@app.command()
def ablate(
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
    mode: str = ModeOpt,
    max_new_tokens: int = NewTokOpt,
    samples_per_prompt: int = SamplesOpt,
    temperature: float = TempOpt,
    top_p: float = TopPOpt,
    clip_eps: float = ClipOpt,
    tis_cap: float = TisOpt,
    regions: str = typer.Option("rope,swiglu,rmsnorm", "--regions", help="Regions to ablate; all 2^k subsets run."),
    side: str = SideOpt,
    metric: str = typer.Option("mean_kl", "--metric", help="What attribution explains: mean_kl, mean_abs_dlogp, max_kl or max_abs_dlogp."),
    bootstrap: int = typer.Option(1000, "--bootstrap", help="Bootstrap resamples of prompts for confidence intervals (0 = none)."),
    report: bool = ReportOpt,
) -> None:
    """Rerun compare with every combination of aligned regions (RoPE, SwiGLU, residual RMSNorm) and attribute
    the vLLM-vs-transformers mismatch to regions with Shapley values and bootstrap intervals.

    Writes compare's files with a combo column, plus ablation.csv (one row per combination) and
    attribution.csv (one row per region, and what remains with all aligned).
    """
    from .ablate import AblateOptions
    from .regions import parse_regions

    generate = _generate_options(mode, max_new_tokens, samples_per_prompt, temperature, top_p, clip_eps, tis_cap)

    def work(probe, progress):
        return probe.ablate(regions=parse_regions(regions), side=side, metric=metric, bootstrap=bootstrap,
                            generate=generate, prompts=prompts, num_prompts=num_prompts,
                            max_prompt_tokens=max_prompt_tokens, taps=taps, threshold=threshold, progress=progress)

    def validate():
        AblateOptions(regions=parse_regions(regions), side=side, metric=metric, bootstrap=bootstrap)
        _check_generate(generate)

    run, out_dir = _run(work, validate, model, out_dir, taps, threshold,
                        dict(infer=infer, dtype=dtype, device=device, train_attn=train_attn, seed=seed,
                             batch_tokens=batch_tokens))
    _print_ablation(run, out_dir)
    if report:
        _write_report(out_dir)


def _print_ablation(run, out_dir: Path) -> None:
    metric = run.options.metric
    combos = run.ablation_table.sort_values(metric, kind="stable")
    table = Table(title=f"ablation ({run.options.side}), sorted by {metric}")
    for col in ("combo", metric, "mean_abs_dlogp", "first_inexact"):
        table.add_column(col, justify="left" if col in ("combo", "first_inexact") else "right")
    for row in combos.itertuples():
        table.add_row(row.combo, f"{getattr(row, metric):.3e}", f"{row.mean_abs_dlogp:.3e}", row.first_inexact)
    out.print(table)
    attr = Table(title=f"attribution of the reduction in {metric}")
    for col in ("region", "shapley", "share", "95% CI", "main effect", "leave-one-out"):
        attr.add_column(col, justify="left" if col == "region" else "right")
    for row in run.attribution_table.itertuples():
        attr.add_row(row.region, f"{row.shapley:.3e}", f"{row.share:.1%}", f"[{row.ci_low:.2e}, {row.ci_high:.2e}]",
                     f"{row.main_effect:.3e}", f"{row.leave_one_out:.3e}")
    out.print(attr)
    out.print(f"run: {out_dir}")


@app.command("report")
def report_command(
    run_dir: Path = typer.Argument(..., help="A run folder (the --out of compare or ablate)."),
    fmt: str = typer.Option("md", "--format", "-f", help="md (report.md + PNG/PDF figures), html (one self-contained report.html) or latex (report.tex, booktabs tables, PDF figures)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="New or empty folder, or one holding a previous report (replaced). Default: RUN_DIR/report."),
) -> None:
    """Render a run folder as a report a reader understands without the tool: setup, headline numbers,
    first divergence, tables and figures (error growth across layers, Δlogprob, KL by position, attribution).
    """
    _write_report(run_dir, out_dir, fmt)


def _write_report(run_dir: Path, out_dir: Optional[Path] = None, fmt: str = "md") -> None:
    from .report import write_report

    try:
        with console.status("rendering the report…"):
            path = write_report(run_dir, out_dir, fmt=fmt)
    except ProbeError as e:
        _fail(e)
    out.print(f"report: {path}")


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
    """The console entry point: SIGTERM stops a command like Ctrl-C (its cleanups run), then one line and 128+N."""
    from .signals import Stopped, stop_on_signals

    try:
        with stop_on_signals():
            app()
    except Stopped as e:
        console.print(f"[bold red]stopped:[/] {e.name} received; nothing was left half-written", highlight=False)
        raise SystemExit(e.code) from None
