"""The rl run's report: what was run (setup), reward and mismatch against step with seeds as a band, the start of
each run against its end (a table and a verdict in words), in Markdown, HTML or LaTeX (reports/document.py, as
compare's report).

    from divergence_probe.reports.rl import write_rl_report
    write_rl_report("runs/rl")                    # runs/rl/report/report.md + figures/rl.png|pdf
    write_rl_report("runs/rl", fmt="html")        # one self-contained report.html

rl.csv and rl_summary.csv are checked against the sha256 the manifest recorded before anything is drawn (a run that
did not finish has no manifest: its rows are plotted with `check=False`, as the rl command does for a stopped run),
and rl.csv must have the columns the figure and the tables read, as numbers. The start-against-end table is computed
from rl.csv by the rl command's own summary (numerics/rl_summary.py summarize), so a run that stopped early gets one too. The
report folder is marked and replaced like the compare report's (rundir.output_folder).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from ..numerics.rl_summary import FLOORS, comparison_words, summarize, window_label
from ..run_folder import read_manifest
from ..rundir import MANIFEST, output_folder
from . import document as doc
from . import figures as F
from .load import ReportError
from .output import FORMATS, REPORT, write_document
from .rl_rows import files_of, read_checked, read_rows

PANELS = (("reward_mean", "mean reward of the step's responses"),
          ("mean_abs_dlogp", "mean |Δlogp| (trainer − engine), sampled tokens"))
BAND = ("the line is the mean over seeds at each step; the shaded band spans the lowest to the highest seed at that "
        "step (min to max, not a confidence interval)")


@F._styled
def rl_curves(rows: pd.DataFrame) -> Figure:
    """Two panels (reward, mismatch) against step; per setting the mean over seeds, and the seeds' range as a band."""
    fig, axes = F._new_figure(ncols=len(PANELS))
    for ax, (column, label) in zip(axes, PANELS):
        for i, (setting, part) in enumerate(rows.groupby("setting", sort=False)):
            by_step = part.groupby("step")[column]
            mean, lo, hi = by_step.mean(), by_step.min(), by_step.max()
            s = F.style(i)
            ax.plot(mean.index, mean.values, color=s["color"], linestyle=s["linestyle"],
                    marker=s["marker"] if len(mean) <= 30 else None, markersize=4,
                    label=f"{setting} ({part.seed.nunique()} seed{'s' if part.seed.nunique() > 1 else ''})")
            if part.seed.nunique() > 1:
                ax.fill_between(mean.index, lo.values, hi.values, color=s["color"], alpha=0.15, hatch=F.HATCHES[i],
                                linewidth=0)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(label)
        if column == "mean_abs_dlogp":
            ax.set_yscale("log")
    axes[0].legend(loc="best")
    return fig


def _setup(manifest: dict | None, rows: pd.DataFrame) -> list[str]:
    """The setup as bullets, from the manifest's recorded spec and load (a run that did not finish has none: the
    settings, seeds and steps are then read off its rows)."""
    spec = manifest.get("spec") if isinstance(manifest, dict) else None
    model = manifest.get("model") if isinstance(manifest, dict) else None
    steps = int(rows.step.max())
    runs = f"{rows.setting.nunique()} setting(s) ({', '.join(f'`{s}`' for s in rows.setting.unique())}) x " \
           f"{rows.seed.nunique()} seed(s) ({', '.join(str(int(s)) for s in sorted(rows.seed.unique()))}), " \
           f"{steps} GRPO step(s) per run"
    if manifest is None:
        return [runs, "no manifest: the run did not finish, so its settings beyond these were not recorded"]
    if not isinstance(spec, dict):
        return [runs, "the manifest records no spec (a run made before rl runs recorded theirs)"]
    parts = [*(spec.get(part) for part in ("load", "prompts")), spec]  # its load's fields, its prompts', rl's own
    get = lambda key: next((part[key] for part in parts if isinstance(part, dict) and key in part), None)  # noqa: E731
    items = [runs]
    if isinstance(model, dict):
        items.append(f"model `{model.get('spec') or model.get('path')}` ({model.get('arch')}, "
                     f"{model.get('num_layers')} layers), on `{get('device')}`")
    engine_args = get("engine_args") or {}
    items += [
        f"engine: vLLM, `{get('engine')}` mode, regions aligned on side `{get('side')}`, prefix caching on"
        + (f", engine args `{json.dumps(engine_args, sort_keys=True)}`" if engine_args else ""),
        f"trainer: transformers, FP32 master weights, AdamW (betas 0.9, 0.95), lr {get('lr')}, "
        f"`{get('train_precision')}` forward and backward, gradient norm clipped at {get('grad_clip')}; BF16 weights "
        "pushed into the engine and verified after every step",
        f"GRPO: {get('prompts_per_step')} prompt(s) x {get('group_size')} responses per step, at most "
        f"{get('max_new_tokens')} new tokens, temperature {get('temperature')}, PPO clip {get('clip_eps')}, "
        f"correction `{get('correction')}`" + (f" (cap {get('tis_cap')})" if get("correction") != "none" else "")
        + f", a step without signal: `{get('no_signal_step')}`",
        f"task: reward `{get('reward') or 'brackets'}` on "
        + (f"the prompts of `{get('prompts')}`" if get("prompts") else "the built-in bracket-closing prompts"),
    ]
    return items


def _verdict(summary: pd.DataFrame) -> list[str]:
    """Per setting, in words: did the reward rise or fall from the first steps to the last, and did the mismatch
    grow, in how many seeds (a direction every seed shares is stated as such; otherwise the split)."""
    out = []
    for setting, part in summary.groupby("setting", sort=False):
        n, label = len(part), window_label(1, int(part.steps.iloc[0]), int(part.window.iloc[0]))
        if int(part.steps.iloc[0]) < 2:
            out.append(f"`{setting}`: one step only; nothing to compare")
            continue

        def moved(start: str, end: str, up: str, down: str, fmt) -> str:
            counts = {up: int((part[end] > part[start]).sum()), down: int((part[end] < part[start]).sum())}
            counts["did not change"] = n - counts[up] - counts[down]
            means = f"{fmt(part[start].mean())} -> {fmt(part[end].mean())}, means over seeds"
            word = next((w if n == 1 else f"{w} in every seed" for w, c in counts.items() if c == n), None)
            if word is None:  # the seeds disagree: say how
                word = " and ".join(f"{w} in {c}" for w, c in counts.items() if c) + f" of {n} seeds"
            return f"{word} ({means})"

        reward = moved("reward_start", "reward_end", "rose", "fell", lambda v: f"{v:.3g}")
        mismatch = moved("mean_abs_dlogp_start", "mean_abs_dlogp_end", "grew", "shrank", doc.sig)
        out.append(f"`{setting}` ({label}): the reward {reward}; the mismatch {mismatch}; {_collapses(part)}")
    return out + comparison_words(summary)


def _collapses(part: pd.DataFrame) -> str:
    """Which seeds of one setting collapsed (numerics/collapse.py), and at which step."""
    fell = part[part.collapsed_at_step.notna()]
    if fell.empty:
        return f"no collapse in {len(part)} seed{'s' if len(part) > 1 else ''}"
    at = ", ".join(f"seed {int(r.seed)} at step {int(r.collapsed_at_step)}" for r in fell.itertuples())
    return f"collapsed in {len(fell)} of {len(part)} seeds ({at})"


def _floors(summary: pd.DataFrame, first) -> str:
    """The noise floors rl measured at each run's first step, beside that step's mismatch, per setting."""
    mismatch = dict(first.mean())
    if not all(f in summary for f in FLOORS):
        return ("This run folder records no noise floor (made before rl measured one). Step 1's mismatch, on the "
                "checkpoint before any update: " + "; ".join(f"`{k}` {doc.sig(float(v))}" for k, v in mismatch.items())
                + ".")
    parts = [f"`{setting}`: mismatch {doc.sig(float(mismatch[setting]))}, engine batch floor "
             f"{doc.sig(float(g.floor_engine_batch.mean()))}, trainer batch floor {doc.sig(float(g.floor_train_batch.mean()))}"
             for setting, g in summary.groupby("setting", sort=False)]
    return ("At each run's first step, on the checkpoint before any update and on the setting's own stacks, each stack "
            "against itself, alone against batched: the engine rolls every sample of the step out again alone "
            "(compared up to the first token that differs), the trainer scores every sequence again alone. Mean "
            "|Δlogp| over seeds: " + "; ".join(parts) + ". A mismatch within its floors is what batching alone "
            "moves.")


SUMMARY_COLUMNS = (
    ("setting", doc.Column("setting", "code")), ("seed", doc.Column("seed", "int")),
    ("reward_start", doc.Column("reward, start", "num")), ("reward_end", doc.Column("reward, end", "num")),
    ("reward_max", doc.Column("reward, max", "num")),
    ("mean_abs_dlogp_start", doc.Column("mean |Δlogp|, start", "num")),
    ("mean_abs_dlogp_end", doc.Column("mean |Δlogp|, end", "num")), ("k3_end", doc.Column("k3, end", "num")),
    ("ppo_clip_frac_end", doc.Column("PPO-clipped, end", "pct")),
    ("entropy_start", doc.Column("entropy, start", "num")), ("entropy_end", doc.Column("entropy, end", "num")),
    ("grad_norm_max", doc.Column("grad norm, max", "num")),
    ("collapsed_at_step", doc.Column("collapsed at step", "int")), ("s_per_step", doc.Column("s/step", "num")),
    ("overhead_frac", doc.Column("overhead", "pct")),
)


def rl_document(rows: pd.DataFrame, manifest: dict | None) -> list:
    """The report's blocks (reports/document.py), rendered to any of its formats."""
    summary = summarize(rows)
    labels = sorted({window_label(1, int(r.steps), int(r.window)) for r in summary.itertuples()})
    first = rows[rows.step == rows.step.min()].groupby("setting", sort=False).mean_abs_dlogp
    return [
        doc.Heading("divergence-probe rl", 1),
        doc.Paragraph("A GRPO loop on one checkpoint: vLLM samples the responses, a verifiable reward scores them, "
                      "transformers computes the update, and the new weights are pushed into the running engine. "
                      "The mismatch is the trainer's logprob of each sampled token minus the engine's."),
        doc.Heading("Setup", 2), doc.Bullets(tuple(_setup(manifest, rows))),
        doc.Heading("Verdict", 2),
        doc.Paragraph(f"Start against end: the mean over the first steps against the mean over the last ones "
                      f"({'; '.join(labels)}; at most 10 steps each, at most half the run, so the two never share a "
                      "step)."),
        doc.Bullets(tuple(_verdict(summary))),
        doc.Heading("Reward and mismatch", 2),
        doc.Figure("rl", "Reward and mismatch against step",
                   f"Left: the mean reward of each step's responses. Right: the mean |Δlogp| over the sampled tokens "
                   f"(log scale). Per setting, {BAND}."),
        doc.Heading("Noise floor", 2),
        doc.Paragraph(_floors(summary, first)),
        doc.Heading("Start against end per run", 2),
        doc.Table("rl_summary", "Each (setting, seed) run: start and end are the means over the steps named in the "
                  "verdict; PPO-clipped is the share of tokens whose ratio left the clip band; overhead is the time "
                  "of the checks, metrics and weight push over that of rollout, reward and update.",
                  tuple(c for _, c in SUMMARY_COLUMNS),
                  tuple(tuple(getattr(r, key) for key, _ in SUMMARY_COLUMNS) for r in summary.itertuples())),
    ]


def write_rl_report(run_dir: str | Path, out_dir: str | Path | None = None, check: bool = True,
                    fmt: str = "md") -> Path:
    """report.md, report.html or report.tex (with its tables' .tex), and figures/rl.png|pdf, into out_dir (default
    run_dir/report)."""
    if fmt not in FORMATS:
        raise ReportError(f"--format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    run_dir = Path(run_dir)
    files = files_of(run_dir, check)
    rows = read_rows(run_dir, check, files)
    if (run_dir / "rl_summary.csv").is_file() or (run_dir / "rl_summary.csv").is_symlink():
        read_checked(run_dir, "rl_summary.csv", files)  # the folder is the one the run wrote (its table is recomputed)
    has_manifest = (run_dir / MANIFEST).is_file()
    manifest = read_manifest(run_dir) if has_manifest else None
    blocks = rl_document(rows, manifest)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    with output_folder(out_dir, REPORT, replaces=REPORT) as tmp:
        F.save(rl_curves(rows), tmp / doc.FIGURE_DIR, "rl")
        write_document(tmp, blocks, fmt, "divergence-probe rl")
    return out_dir / FORMATS[fmt]
