"""Render a run folder (compare, ablate or generate) as a report a reader understands without the tool.

    from divergence_probe.report import write_report
    write_report("runs/qwen")                         # runs/qwen/report/report.md + figures/*.png|pdf
    write_report("runs/qwen", fmt="html")             # one self-contained report.html (PNGs inlined)
    write_report("runs/qwen", "paper/", fmt="latex")  # report.tex, summary.tex, ablation.tex, ... + PDFs

The run type is read from the files present: ablation.csv makes an ablate run; a `generate` manifest section
or tokens with `is_response` make a generate run; otherwise a compare run. tokens.csv may also be
tokens.csv.gz, or absent (then the token figures are skipped and the report says so).

Output is written like every other output of the tool: into a hidden sibling folder renamed into place
when complete. A folder that holds exactly a previous report (its file list is recorded in
`.divergence-probe-report`) is replaced on re-render; any other non-empty folder is an OutputError.
Identical inputs give byte-identical output: nothing in it depends on the time, the machine or the out path.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .errors import OutputError, ProbeError
from .reports import document as doc
from .reports.document import Bullets, Column, Figure, Heading, Paragraph, Table, sig

FORMATS = {"md": "report.md", "html": "report.html", "latex": "report.tex"}
MARKER = ".divergence-probe-report"  # lists the files of a report folder, so a re-render may replace it
KEY_TAPS = ("q_rope", "attn_core", "post_norm", "swiglu", "resid_out")
DEFAULT_CLIP_EPS = 0.2
SHIPPED = "none"
REMAINING = "(remaining)"
TOKEN_FILES = ("tokens.csv", "tokens.csv.gz")

# Column meanings as the README documents them ("Output files", "Reading the RL metrics", "The noise floor").
# In generate mode r = logprob_train − logprob_infer of a sampled response token and ρ = exp(r).
SUMMARY_MEANINGS = {
    "mean_abs_dlogp": "mean |Δlogprob| over scored tokens (nats)",
    "max_abs_dlogp": "largest |Δlogprob| (nats)",
    "p99_abs_dlogp": "99th percentile of |Δlogprob| (nats)",
    "std_abs_dlogp": "standard deviation of |Δlogprob| (nats)",
    "mean_kl": "mean per-token KL(π_infer ‖ π_train) over the full vocabulary (nats)",
    "max_kl": "largest per-token KL (nats)",
    "first_inexact": "first tap, in forward order, that is not bitwise equal (`tap@layer`)",
    "first_over_threshold": "first tap whose rel_l2 exceeds the threshold",
    "n_tokens": "scored tokens",
    "prompt_mean_abs_dlogp": "mean |Δlogprob| over the prompt tokens (nats)",
    "prompt_mean_kl": "mean full-vocabulary KL over the prompt tokens (nats)",
    "mean_abs_dp": "mean |π_train − π_infer| of the sampled token (probability)",
    "max_abs_dp": "largest |π_train − π_infer| of the sampled token (probability)",
    "k1": "mean of −r: k1 estimator of KL(π_infer ‖ π_train) from samples (nats)",
    "k2": "mean of r²/2: k2 estimator of the KL (nats)",
    "k3": "mean of (ρ − 1) − r: k3 estimator of the KL, ≥ 0 (nats)",
    "ratio_mean": "mean importance ratio ρ",
    "ratio_std": "standard deviation of ρ",
    "ratio_min": "smallest ρ",
    "ratio_max": "largest ρ",
    "ppo_clip_frac": "fraction of response tokens with ρ outside [1−ε, 1+ε]: PPO clipping from numerics alone",
    "tis_truncated_frac": "fraction with ρ above the TIS cap C (truncated importance sampling)",
    "mis_masked_frac": "fraction with ρ outside [1/C, C] (masked importance sampling)",
    "ess": "effective sample size fraction (Σρ)²/(n Σρ²), in (0, 1]",
    "n_response_tokens": "response tokens",
    "seq_mean_abs_logratio": "mean over responses of |Σ r| (nats)",
    "seq_max_abs_logratio": "largest |Σ r| over responses (nats)",
    "mean_logppl_diff": "mean over responses of log PPL_train − log PPL_infer",
    "ppl_ratio": "exp(mean_logppl_diff): PPL_train / PPL_infer",
    "seq_geo_ratio_outside_frac": "fraction of responses whose geometric-mean ratio is outside [1−ε, 1+ε]",
    "n_sequences": "responses",
    "noise_infer_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the inference stack, one sequence per call vs one batch",
    "noise_train_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the training stack, one sequence per call vs one batch",
}
# The columns of buckets.csv the report shows (the CSV has every token metric per bucket).
BUCKET_COLUMNS = ("group", "bucket", "n_tokens", "mean_kl", "mean_abs_dlogp", "max_abs_dlogp", "k3", "ratio_min",
                  "ratio_max", "ppo_clip_frac")


class ReportError(ProbeError):
    """The run folder given to `report` is missing, is not a run folder, or has unreadable files."""


# ---------------------------------------------------------------------------------------------- loading
@dataclass
class RunData:
    """Everything a report reads from one run folder."""

    path: Path
    manifest: dict
    summary: pd.DataFrame
    layers: pd.DataFrame
    tokens: pd.DataFrame | None = None
    tokens_file: str | None = None
    ablation: pd.DataFrame | None = None
    attribution: pd.DataFrame | None = None
    extra: dict = field(default_factory=dict)  # optional tables by file stem: buckets, batch_invariance
    n_prompts: int | None = None
    n_truncated: int = 0

    @property
    def is_ablate(self) -> bool:
        return self.ablation is not None

    @property
    def is_generate(self) -> bool:
        return "generate" in self.manifest or (self.tokens is not None and "is_response" in self.tokens)

    @property
    def kind(self) -> str:
        return "generate" if self.is_generate else "ablate" if self.is_ablate else "compare"

    @property
    def regions(self) -> list[str]:
        listed = self.manifest.get("ablate", {}).get("regions")
        if listed:
            return [r for r in listed if r in self.ablation.columns]
        return [c for c in self.ablation.columns if self.ablation[c].dtype == bool]

    @property
    def metric(self) -> str:
        return self.manifest.get("ablate", {}).get("metric", "mean_kl")

    @property
    def combos(self) -> list[str]:
        return list(self.ablation["combo"]) if self.is_ablate else []

    @property
    def all_aligned(self) -> str | None:
        if not self.is_ablate or not self.regions:
            return None
        full = self.ablation[self.ablation[self.regions].astype(bool).all(axis=1)]
        return str(full["combo"].iloc[0]) if len(full) else None

    @property
    def num_layers(self) -> int | None:
        n = self.manifest.get("model", {}).get("num_layers")
        if isinstance(n, int):
            return n
        from .taps import LAYER_TAPS

        decoder = self.layers[self.layers["tap"].isin(LAYER_TAPS)]
        return int(decoder["layer"].max()) + 1 if len(decoder) else None

    @property
    def clip_eps(self) -> float:
        return float(self.manifest.get("generate", {}).get("clip_eps", DEFAULT_CLIP_EPS))


def _read_csv(path: Path, required: tuple[str, ...] = (), **kwargs) -> pd.DataFrame:
    # Only empty fields are missing values: tap labels like `none` and combo names stay strings.
    try:
        df = pd.read_csv(path, keep_default_na=False, na_values=[""], **kwargs)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError, EOFError, ValueError) as e:
        raise ReportError(f"cannot read {path} ({e}); it is not a file divergence-probe wrote, or it was "
                          "cut short: rerun the command that made the run folder") from e
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ReportError(f"{path} lacks the column(s) {', '.join(missing)}; was it written by this version "
                          "of divergence-probe? Rerun the command that made the run folder")
    return df


def _as_bool(series: pd.Series) -> pd.Series:
    if series.dtype == bool:
        return series
    return series.astype(str).str.strip().str.lower().isin(("true", "1", "yes"))


def load_run(run_dir: str | Path) -> RunData:
    """Read a run folder; ReportError when it is missing or is not one."""
    path = Path(run_dir)
    if not path.exists():
        raise ReportError(f"run folder {path} does not exist; pass the --out folder of a compare or ablate run")
    if not path.is_dir():
        raise ReportError(f"{path} is a file, not a run folder; pass the --out folder of a compare or ablate run")
    if not (path / "manifest.json").is_file() or not (path / "summary.csv").is_file():
        lacking = [f for f in ("manifest.json", "summary.csv") if not (path / f).is_file()]
        raise ReportError(f"{path} is not a divergence-probe run folder (no {' or '.join(lacking)}); pass the "
                          "--out folder of a compare or ablate run")
    try:
        manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportError(f"cannot read {path / 'manifest.json'} ({e}); rerun the command that made the run folder") from e
    if not isinstance(manifest, dict):
        raise ReportError(f"{path / 'manifest.json'} is not a JSON object; rerun the command that made the run folder")

    summary = _read_csv(path / "summary.csv")
    if summary.empty:
        raise ReportError(f"{path / 'summary.csv'} has no rows; rerun the command that made the run folder")
    layers_path = path / "layers.csv"
    layers = (_read_csv(layers_path, ("layer", "tap", "rel_l2")) if layers_path.is_file()
              else pd.DataFrame(columns=["layer", "tap", "rel_l2"]))
    run = RunData(path=path, manifest=manifest, summary=summary, layers=layers)

    if (path / "ablation.csv").is_file():
        run.ablation = _read_csv(path / "ablation.csv", ("combo",))
        for region in run.regions:
            run.ablation[region] = _as_bool(run.ablation[region])
        if run.metric not in run.ablation.columns:
            raise ReportError(f"{path / 'ablation.csv'} has no column {run.metric!r} (the manifest's ablate "
                              "metric); rerun the ablation")
    if (path / "attribution.csv").is_file():
        run.attribution = _read_csv(path / "attribution.csv", ("region", "shapley", "share"))
        for col in ("main_effect", "leave_one_out", "ci_low", "ci_high"):
            if col not in run.attribution:
                run.attribution[col] = np.nan

    for name in TOKEN_FILES:
        if (path / name).is_file():
            # The token strings are not needed and can be anything; skip them.
            run.tokens = _read_csv(path / name, ("prompt_id", "position", "logprob_infer", "delta_logprob", "kl"),
                                   usecols=lambda c: c != "token")
            run.tokens_file = name
            if "is_response" in run.tokens:
                run.tokens["is_response"] = _as_bool(run.tokens["is_response"])
            break

    for stem in ("buckets", "batch_invariance"):
        if (path / f"{stem}.csv").is_file():
            run.extra[stem] = _read_csv(path / f"{stem}.csv")

    prompts = path / "prompts.jsonl"
    if prompts.is_file():
        records = [json.loads(line) for line in prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
        run.n_prompts = len(records)
        run.n_truncated = sum(bool(r.get("truncated")) for r in records)
    elif run.tokens is not None:
        run.n_prompts = int(run.tokens["prompt_id"].nunique())
    return run


# ---------------------------------------------------------------------------------------------- helpers
def _get(mapping, *keys, default=None):
    for key in keys:
        if not isinstance(mapping, dict) or key not in mapping:
            return default
        mapping = mapping[key]
    return mapping


def _code(value) -> str:
    return "`" + str(value).replace("`", "'") + "`"


def _num(value) -> str:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return str(value)
    return "n/a" if math.isnan(x) else sig(x)


def _versions(d: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted((d or {}).items())) or "unknown"


def _where(label: str, num_layers: int | None) -> str:
    """Plain words for `tap@layer`."""
    tap, _, layer = label.partition("@")
    try:
        k = int(layer)
    except ValueError:
        return _code(label)
    if k < 0:
        place = "the embedding"
    elif num_layers is not None and k >= num_layers:
        place = "after the last decoder layer"
    else:
        place = f"decoder layer {k}"
    return f"{_code(label)} (tap `{tap}` at {place})"


def _row_of(frame: pd.DataFrame, combo: str | None) -> pd.Series:
    if combo is not None and "combo" in frame:
        match = frame[frame["combo"] == combo]
        if len(match):
            return match.iloc[0]
    return frame.iloc[0]


def _layers_of(run: RunData, combo: str | None) -> pd.DataFrame:
    if "combo" in run.layers and combo is not None:
        return run.layers[run.layers["combo"] == combo]
    return run.layers


def _response_rho(run: RunData) -> np.ndarray | None:
    if run.tokens is None or "is_response" not in run.tokens:
        return None
    t = run.tokens
    if "combo" in t:
        t = t[t["combo"] == SHIPPED]
    return np.exp(t.loc[t["is_response"], "delta_logprob"].to_numpy(dtype=np.float64))


def _token_series(run: RunData) -> list[tuple[str, pd.DataFrame]]:
    t = run.tokens
    if run.is_ablate and "combo" in t:
        names = [SHIPPED] + ([run.all_aligned] if run.all_aligned and run.all_aligned != SHIPPED else [])
        tags = {SHIPPED: "as shipped", run.all_aligned: "all aligned"}
        return [(f"{tags[n]} ({n})", t[t["combo"] == n]) for n in names if (t["combo"] == n).any()]
    if "is_response" in t:
        parts = [("prompt tokens", t[~t["is_response"]]), ("response tokens", t[t["is_response"]])]
        return [(label, part) for label, part in parts if len(part)]
    return [("all scored tokens", t)]


def _kl_panels(run: RunData, series: list[tuple[str, pd.DataFrame]]) -> list:
    """Panels of the KL-by-position figure. Generate mode: prompt tokens by position, response tokens by
    position in the response (their absolute positions depend on each prompt's length)."""
    def frame(df: pd.DataFrame, x: pd.Series) -> pd.DataFrame:
        seq = df["prompt_id"].astype(str) + ("/" + df["sample_id"].astype(str) if "sample_id" in df else "")
        return pd.DataFrame({"x": x.to_numpy(), "kl": df["kl"].to_numpy(), "seq": seq.to_numpy()})

    t = run.tokens
    if "is_response" not in t:
        return [("per-token KL along the sequence", "token position in the prompt (index)",
                 [(label, frame(df, df["position"])) for label, df in series])]
    if "combo" in t:
        t = t[t["combo"] == SHIPPED]
    keys = ["prompt_id", "sample_id"] if "sample_id" in t else ["prompt_id"]
    prompt, response = t[~t["is_response"]], t[t["is_response"]]
    start = response.groupby(keys)["position"].transform("min")
    return [("prompt tokens", "token position in the prompt (index)", [("prompt", frame(prompt, prompt["position"]))]),
            ("response tokens", "token position in the response (index)",
             [("response", frame(response, response["position"] - start))])]


# ---------------------------------------------------------------------------------------------- document
def _setup(run: RunData) -> list:
    m = run.manifest
    model, load, env = m.get("model", {}), m.get("load", {}), m.get("environment", {})
    infer, train = _get(m, "stacks", "infer", default={}), _get(m, "stacks", "train", default={})
    items = [
        f"Model: {_code(model.get('spec', 'unknown'))} (architecture `{model.get('arch', 'unknown')}`, "
        f"{model.get('num_layers', 'unknown')} decoder layers"
        + (f", config.json sha256 `{str(model['config_sha256'])[:12]}…`" if model.get("config_sha256") else "") + ")",
        f"Precision and device: `{load.get('dtype', 'unknown')}` on `{load.get('device', 'unknown')}`"
        + (f" ({env['gpu']})" if env.get("gpu") else "") + (f"; CPU {env['cpu']}" if env.get("cpu") else ""),
        f"Inference stack: `{infer.get('name', load.get('infer', 'unknown'))}` ({_versions(infer.get('versions'))})",
        f"Training stack: `{train.get('name', load.get('train', 'unknown'))}` ({_versions(train.get('versions'))})"
        + (f", attention `{load['train_attn']}`" if load.get("train_attn") else ""),
    ]
    if infer.get("settings"):
        items.append("Inference settings: " + ", ".join(f"{k}={_code(v)}" for k, v in sorted(infer["settings"].items())))
    prompts = f"{run.n_prompts} prompts" if run.n_prompts is not None else "unknown number of prompts"
    if run.n_truncated:
        prompts += f" ({run.n_truncated} truncated to {_get(m, 'compare', 'max_prompt_tokens')} tokens)"
    source = _get(m, "compare", "prompts")
    n_tokens = _row_of(run.summary, SHIPPED).get("n_tokens")
    items.append(f"Prompts: {prompts}" + (f" from {_code(Path(str(source)).name)}" if source else "")
                 + (f", {int(n_tokens)} scored tokens" if n_tokens is not None and not pd.isna(n_tokens) else ""))
    taps = _get(m, "compare", "taps")
    items.append(f"Seed: `{load.get('seed', 'unknown')}`; divergence threshold (rel_l2): "
                 f"`{_get(m, 'compare', 'threshold', default='unknown')}`; taps captured: "
                 + (f"{len(taps)}" if isinstance(taps, list) else "unknown"))
    if run.is_ablate:
        a = m.get("ablate", {})
        side = {"both": "both stacks", "train": "the training stack only (the engine as shipped)",
                "infer": "the inference stack only"}.get(a.get("side"), str(a.get("side", "unknown")))
        items.append(f"Ablation: regions {', '.join(_code(r) for r in run.regions)} aligned in every "
                     f"combination ({len(run.combos)} runs) on {side}; metric `{run.metric}`; "
                     f"{a.get('bootstrap', 'unknown')} bootstrap draws (seed `{a.get('seed', 'unknown')}`)")
    if "generate" in m:
        g = m["generate"]
        desc = ", ".join(f"{k}={_code(v)}" for k, v in sorted(g.items())) if isinstance(g, dict) else _code(g)
        items.append(f"Generation: {desc}; importance-ratio clip ε = {run.clip_eps:g}")
    if env.get("python") or env.get("platform"):
        items.append(f"Environment: Python {env.get('python', '?')} on {_code(env.get('platform', '?'))}")
    if m.get("command"):
        command = m["command"]
        items.append("Command: " + _code(" ".join(map(str, command)) if isinstance(command, list) else command))
    blocks: list = [Heading("Setup"), Bullets(tuple(items))]

    impl_i, impl_t = infer.get("implementations", {}), train.get("implementations", {})
    regions = list(dict.fromkeys([*impl_i, *impl_t]))
    if regions:
        blocks.append(Table(
            "implementations",
            "What each region ran as, per stack (from the manifest: the function or kernel each stack dispatched to).",
            (Column("region", "code"), Column(f"inference ({infer.get('name', 'infer')})", "longcode"),
             Column(f"training ({train.get('name', 'train')})", "longcode")),
            tuple((r, impl_i.get(r), impl_t.get(r)) for r in regions)))
    return blocks


def _zero_run(row: pd.Series) -> bool:
    cols = [c for c in ("mean_abs_dlogp", "max_abs_dlogp", "mean_kl", "max_kl") if c in row]
    return bool(cols) and all(float(row[c]) == 0.0 for c in cols)


def _headline(run: RunData) -> list:
    shipped = _row_of(run.summary, SHIPPED)
    blocks: list = [Heading("Headline numbers")]

    def sentence(row: pd.Series) -> str:
        parts = []
        if "mean_abs_dlogp" in row:
            parts.append(f"the logprobs the two stacks give the same token differ by **{_num(row['mean_abs_dlogp'])}** "
                         f"nats on average (|Δlogprob|; 99th percentile {_num(row.get('p99_abs_dlogp'))}, "
                         f"max {_num(row.get('max_abs_dlogp'))})")
        if "mean_kl" in row:
            parts.append(f"the mean per-token KL(π_infer ‖ π_train) over the full vocabulary is "
                         f"**{_num(row['mean_kl'])}** nats (max {_num(row.get('max_kl'))})")
        return " and ".join(parts)

    n = shipped.get("n_tokens")
    what = "response tokens" if run.is_generate and "n_response_tokens" in shipped else "scored tokens"
    lead = f"Over {int(n)} {what}" if n is not None and not pd.isna(n) else f"Over the {what}"
    if run.is_generate and "n_sequences" in shipped and not pd.isna(shipped["n_sequences"]):
        lead += f" ({int(shipped['n_sequences'])} sampled responses)"
    if run.is_ablate:
        lead += f" with the stacks as shipped (combination `{SHIPPED}`)"
    blocks.append(Paragraph(f"{lead}, {sentence(shipped)}."))
    if "prompt_mean_abs_dlogp" in shipped:
        blocks.append(Paragraph(
            f"On the prompt tokens, scored in the same forward passes, the mean |Δlogprob| is "
            f"{_num(shipped['prompt_mean_abs_dlogp'])} nats and the mean KL {_num(shipped.get('prompt_mean_kl'))} nats."))
    if _zero_run(shipped):
        blocks.append(Paragraph("Every number is exactly 0: the two stacks agree bitwise on every scored token."))
    if run.is_ablate and run.all_aligned:
        full = _row_of(run.ablation, run.all_aligned)
        m, before, after = run.metric, float(shipped[run.metric]), float(full[run.metric])
        change = (f" ({sig(100 * abs(after - before) / before)}% {'lower' if after < before else 'higher'} than "
                  "shipped)" if before and after != before else "")
        best = run.ablation.sort_values(m, kind="stable").iloc[0]
        blocks.append(Paragraph(
            f"With every region aligned (`{run.all_aligned}`), {sentence(full)}. The ablation metric `{m}` goes "
            f"from {_num(before)} to {_num(after)}{change}; the lowest `{m}` of all combinations is "
            f"{_num(best[m])}, with `{best['combo']}`."))
    rho = _response_rho(run)
    if rho is not None and len(rho):
        eps = run.clip_eps
        outside = int(((rho < 1 - eps) | (rho > 1 + eps)).sum())
        blocks.append(Paragraph(
            f"On the {len(rho)} response tokens, the importance ratio ρ = exp(logprob_train − logprob_infer) "
            f"ranges from {_num(rho.min())} to {_num(rho.max())} (mean {_num(rho.mean())}; mean |ρ − 1| "
            f"{_num(np.abs(rho - 1).mean())}); {outside} tokens ({_num(100 * outside / len(rho))}%) fall "
            f"outside the clip band [{1 - eps:g}, {1 + eps:g}] (ε = {eps:g}) and would be clipped by a "
            "PPO-style objective purely because the stacks round differently."))
    rl = [f"`{c}` {_num(shipped[c])}" for c in ("k3", "tis_truncated_frac", "mis_masked_frac", "ess",
                                                  "seq_max_abs_logratio", "ppl_ratio") if c in shipped]
    if rl:
        blocks.append(Paragraph("Other RL diagnostics from summary.csv (meanings in the summary table below): "
                                + ", ".join(rl) + "."))
    blocks += _noise_floor(run, shipped)
    blocks.append(Paragraph("Numbers in this report are rounded to 3 significant digits (scientific notation "
                            "below 1e-4); the run's CSV files hold full precision."))
    return blocks


def _noise_floor(run: RunData, shipped: pd.Series) -> list:
    """The batch-composition noise of each stack, set against the vLLM-vs-transformers mismatch."""
    infer, train = shipped.get("noise_infer_mean_abs_dlogp"), shipped.get("noise_train_mean_abs_dlogp")
    if infer is None or train is None or pd.isna(infer) or pd.isna(train):
        return []
    mismatch = float(shipped.get("mean_abs_dlogp", float("nan")))
    text = (f"Noise floor: scoring the same sequences one at a time and then in one batch changes the inference "
            f"stack's logprobs by {_num(infer)} nats on average and the training stack's by {_num(train)} nats "
            "(batch_invariance.csv).")
    if float(train) > 0 and not math.isnan(mismatch):
        ratio = mismatch / float(train)
        text += (f" The mismatch between the stacks, {_num(mismatch)}, is {_num(ratio)}× the training stack's own "
                 "batch noise" + ("; a mismatch no larger than that noise is not a numerics bug in the engine."
                                  if ratio <= 1 else "."))
    return [Paragraph(text)]


def _first_divergence(run: RunData) -> list:
    shipped = _row_of(run.summary, SHIPPED)
    combo = SHIPPED if run.is_ablate else None
    layers = _layers_of(run, combo)
    n_layers = run.num_layers
    threshold = _get(run.manifest, "compare", "threshold")
    blocks: list = [Heading("First divergence")]
    first, over = str(shipped.get("first_inexact", "not captured")), str(shipped.get("first_over_threshold", ""))
    scope = " (stacks as shipped)" if run.is_ablate else ""
    if first == "not captured":
        blocks.append(Paragraph(f"No taps were captured in this run (`--taps none`), so only the "
                                "token-level numbers are available."))
        return blocks
    if first == "none":
        blocks.append(Paragraph(f"Every captured tap is bitwise equal in the two stacks{scope}: no divergence."))
        return blocks
    text = f"The first tap, in the order data flows through the model, whose values are not bitwise equal{scope} is {_where(first, n_layers)}"
    tap, _, layer = first.partition("@")
    row = layers[(layers["tap"] == tap) & (layers["layer"].astype(str) == layer)]
    if len(row):
        r = row.iloc[0]
        details = []
        if "frac_equal" in r:
            details.append(f"{_num(100 * float(r['frac_equal']))}% of its elements still equal")
        if "max_ulp" in r:
            details.append(f"largest distance {_num(r['max_ulp'])} ULP")
        details.append(f"rel_l2 {_num(r['rel_l2'])}")
        text += ": " + ", ".join(details)
    text += "."
    if over and over != first:
        text += (f" The first tap whose relative L2 error exceeds the threshold {threshold} is "
                 + (_where(over, n_layers) if over not in ("none", "not captured") else "none") + ".")
    elif over == first:
        text += f" It is also the first tap whose relative L2 error exceeds the threshold {threshold}."
    resid = layers[layers["tap"] == "resid_out"]
    if len(resid) and resid["rel_l2"].notna().any():
        worst = resid.loc[resid["rel_l2"].idxmax()]
        last = resid.loc[resid["layer"].idxmax()]
        first_row = resid.loc[resid["layer"].idxmin()]
        text += (f" The decoder-layer output (`resid_out`) goes from rel_l2 {_num(first_row['rel_l2'])} after "
                 f"layer {int(first_row['layer'])} to {_num(last['rel_l2'])} after layer {int(last['layer'])}")
        text += (f", largest at layer {int(worst['layer'])} ({_num(worst['rel_l2'])})."
                 if int(worst["layer"]) != int(last["layer"]) else ".")
    blocks.append(Paragraph(text))
    if run.is_ablate:
        blocks.append(Paragraph("The ablation table below gives the first divergence of every combination."))
    return blocks


def _summary_table(run: RunData) -> Table:
    s = run.summary
    cols = [c for c in s.columns if c != "combo"]

    def meaning(c: str) -> str:
        if c == "first_over_threshold" and _get(run.manifest, "compare", "threshold") is not None:
            return f"first tap whose rel_l2 exceeds {_get(run.manifest, 'compare', 'threshold')}"
        if c in SUMMARY_MEANINGS:
            text = SUMMARY_MEANINGS[c]
            return text.replace("scored tokens", "response tokens") if run.is_generate else text
        if c.startswith("ratio_"):
            return "importance-ratio statistic, ρ = exp(Δlogprob) on response tokens (see README)"
        return ""

    def value(v):
        return v.item() if isinstance(v, np.generic) else v

    if "combo" in s:
        shown = [SHIPPED] + ([run.all_aligned] if run.all_aligned and run.all_aligned != SHIPPED else [])
        shown = [c for c in shown if (s["combo"] == c).any()] or [str(s["combo"].iloc[0])]
        rows = tuple((c, *(value(_row_of(s, k)[c]) for k in shown), meaning(c)) for c in cols)
        return Table("summary", "Headline numbers (summary.csv): as shipped and with every region aligned.",
                     (Column("quantity", "code"), *(Column(k, "auto") for k in shown), Column("meaning", "prose")),
                     rows)
    if len(s) == 1:
        rows = tuple((c, value(s.iloc[0][c]), meaning(c)) for c in cols)
        return Table("summary", "Headline numbers (summary.csv).",
                     (Column("quantity", "code"), Column("value", "auto"), Column("meaning", "prose")), rows)
    return _generic_table("summary", "Headline numbers (summary.csv).", s)


def _kind(series: pd.Series) -> str:
    if series.dtype == bool:
        return "bool"
    if pd.api.types.is_integer_dtype(series):
        return "int"
    if pd.api.types.is_float_dtype(series):
        return "num"
    return "code"


def _generic_table(name: str, caption: str, df: pd.DataFrame) -> Table:
    columns = tuple(Column(c, _kind(df[c])) for c in df.columns)
    rows = tuple(tuple(None if pd.isna(v) else v for v in row) for row in df.itertuples(index=False, name=None))
    return Table(name, caption, columns, rows)


def _ablation_table(run: RunData) -> Table:
    df = run.ablation.sort_values(run.metric, kind="stable")
    caption = (f"Every combination of aligned regions (ablation.csv), sorted by `{run.metric}`, lowest first; "
               "yes = the region is aligned (FP32 until its output, one rounding).")
    if "n_tokens" in df and df["n_tokens"].nunique() == 1:
        caption += f" Every combination scores the same {int(df['n_tokens'].iloc[0])} tokens."
        df = df.drop(columns=["n_tokens"])
    first = ["combo", *run.regions, run.metric]
    df = df[first + [c for c in df.columns if c not in first]]
    table = _generic_table("ablation", caption, df)
    return Table(table.name, table.caption, tuple(
        Column(c.title, "bool" if c.title in run.regions else c.kind) for c in table.columns), table.rows)


def _attribution_table(run: RunData) -> Table:
    a = run.attribution
    cols = [("region", "code"), ("shapley", "num"), ("share", "pct"), ("main_effect", "num"),
            ("leave_one_out", "num"), ("ci_low", "num"), ("ci_high", "num")]
    rows = tuple(tuple(None if pd.isna(r[c]) else r[c] for c, _ in cols) for _, r in a.iterrows())
    return Table("attribution",
                 f"Attribution of the reduction in `{run.metric}` to regions (attribution.csv); share in percent; "
                 "ci_low/ci_high: 95% bootstrap interval of shapley.",
                 tuple(Column(c, k) for c, k in cols), rows)


def _attribution_reading(run: RunData) -> Paragraph:
    m = run.metric
    draws = _get(run.manifest, "ablate", "bootstrap", default="the")
    return Paragraph(
        f"**How to read the attribution.** Write m for `{m}` and v(S) = m(`none`) − m(S) for how much aligning "
        "the set of regions S reduces it. A region's `shapley` value is its average marginal reduction over "
        "every order in which the regions could be aligned; the regions' values add up exactly to v(all), and "
        "`share` is a region's fraction of that total. `main_effect` is the reduction from aligning the region "
        "alone, `leave_one_out` what is lost by leaving it out of the full alignment: a large main effect with "
        "a small leave-one-out means its effect overlaps other regions', the reverse that it only matters "
        "together with them. A negative value means aligning the region makes the stacks disagree more. "
        f"`ci_low`–`ci_high` is a 95% percentile bootstrap interval ({draws} resamples of prompts with "
        "replacement); an interval that contains 0 means the effect is not distinguishable from "
        f"prompt-to-prompt noise. The last row, `{REMAINING}`, is not a region: its `shapley` is the metric left "
        "with every region aligned (GEMMs, attention kernels and everything outside the regions) and its "
        "`share` that remainder as a fraction of the shipped metric.")


def _tables(run: RunData) -> list:
    blocks: list = [Heading("Tables"), _summary_table(run)]
    if run.is_ablate:
        blocks.append(_ablation_table(run))
    if run.attribution is not None:
        blocks += [_attribution_table(run), _attribution_reading(run)]
    if "buckets" in run.extra:
        b = run.extra["buckets"]
        shown = b[[c for c in BUCKET_COLUMNS if c in b.columns]]
        empty = int((shown["n_tokens"] == 0).sum()) if "n_tokens" in shown else 0
        if empty:
            shown = shown[shown["n_tokens"] > 0]
        blocks.append(_generic_table(
            "buckets", "Response-token metrics per bucket of the inference-side probability of the sampled token "
            "(`group` p_infer) and per response-position range (`group` response_position), from buckets.csv"
            + (f"; {empty} empty buckets left out" if empty else "") + ". The CSV has every token metric per bucket.",
            shown))
    if "batch_invariance" in run.extra:
        blocks.append(_generic_table(
            "batch_invariance", "Noise floor (batch_invariance.csv): each stack scores the same sequences one per "
            "call and then all in one batch; the columns compare the two.", run.extra["batch_invariance"]))
    return blocks


# ---------------------------------------------------------------------------------------------- figures
@dataclass(frozen=True)
class FigureSpec:
    stem: str
    title: str
    caption: str
    draw: object  # () -> matplotlib Figure


def _figure_specs(run: RunData) -> tuple[list[FigureSpec], list[str]]:
    """The figures that apply to this run, and sentences about those that were skipped."""
    from .reports import figures as F
    from .taps import LAYER_TAPS

    specs: list[FigureSpec] = []
    skipped: list[str] = []
    n_layers = run.num_layers
    layers = run.layers
    if n_layers is not None and len(layers):
        layers = layers[(layers["layer"] >= 0) & (layers["layer"] < n_layers) & layers["tap"].isin(LAYER_TAPS)]
    base = _layers_of(run, SHIPPED if run.is_ablate else None)
    present = set(base["tap"]) & set(layers["tap"])
    taps = tuple(t for t in KEY_TAPS if t in present) or tuple(t for t in LAYER_TAPS if t in present)[:5]
    if taps:
        combos = (tuple(c for c in run.combos if (layers["combo"] == c).any())
                  if run.is_ablate and "combo" in layers else ())
        caption = ("Relative L2 error ‖a − b‖/‖b‖ between the inference (a) and training (b) tensors at each "
                   "decoder layer, over all prompts and tokens, on a log scale (a gap: bitwise equal there). "
                   "A curve that climbs with depth means rounding differences compound through the residual stream.")
        if combos:
            caption += (" Left: key taps as shipped. Right: the decoder-layer output `resid_out` for every "
                        "combination of aligned regions; lower is closer.")
        specs.append(FigureSpec("layers", "Error growth across layers", caption,
                                lambda: F.layer_growth(layers, taps, combos=combos, shipped=SHIPPED)))
    else:
        skipped.append("No decoder-layer taps were captured, so the error-growth figure is not drawn.")

    if run.tokens is None:
        skipped.append("This run folder has no tokens.csv (nor tokens.csv.gz), so the token-level figures "
                       "(Δlogprob histogram, |Δlogprob| against probability, KL along the position) are not drawn.")
    else:
        series = _token_series(run)
        specs.append(FigureSpec(
            "delta_hist", "Distribution of Δlogprob",
            "Δlogprob = logprob_train − logprob_infer of every scored token, in nats. A narrow peak "
            "symmetric about 0 means the stacks differ by rounding noise; a shifted peak means one stack "
            "systematically gives the scored tokens more probability.",
            lambda: F.delta_histogram([(label, df["delta_logprob"].to_numpy()) for label, df in series])))
        specs.append(FigureSpec(
            "delta_vs_prob", "|Δlogprob| against token probability",
            "Each point is one scored token (at most 20000 per series, sampled with a fixed seed): its probability "
            "under the inference stack against |Δlogprob|, log-log. Lines: the median |Δlogprob| per probability "
            "bin. Tokens with exactly equal logprobs cannot be drawn on a log axis; the legend counts them.",
            lambda: F.delta_vs_probability([(label, df["logprob_infer"].to_numpy(), df["delta_logprob"].to_numpy())
                                            for label, df in series])))
        specs.append(FigureSpec(
            "kl_by_position", "Per-token KL along the position",
            "Exact KL(π_infer ‖ π_train) over the full vocabulary at each token position, averaged over the "
            "sequences that reach that position (log scale). Fewer sequences reach late positions, so the tail "
            "is noisier; a rising trend means the mismatch accumulates with context length."
            + (" Left: prompt tokens by position in the prompt; right: response tokens by position in the "
               "response (0 = first sampled token)." if "is_response" in run.tokens else ""),
            lambda: F.kl_by_position(_kl_panels(run, series))))
    if run.attribution is not None:
        specs.append(FigureSpec(
            "attribution", "Attribution to regions",
            f"Bars: each region's Shapley value, its average reduction of `{run.metric}` when aligned; whiskers: "
            "95% bootstrap interval over prompts. Labels: share of the total reduction. The dotted grey bar is "
            "the metric left with every region aligned, labelled with its fraction of the shipped metric.",
            lambda: F.attribution_bars(run.attribution, run.metric, REMAINING)))
    rho = _response_rho(run)
    if rho is not None:
        eps = run.clip_eps
        specs.append(FigureSpec(
            "ratio_hist", "Importance ratio on response tokens",
            f"Histogram of ρ = exp(Δlogprob) over response tokens, with the clip band "
            f"[1 − ε, 1 + ε], ε = {eps:g}, hatched. Any token outside the band is clipped by a PPO-style "
            "objective only because the two stacks round differently: the policy is the same.",
            lambda: F.ratio_histogram(rho, eps)))
    elif run.is_generate:
        skipped.append("No response tokens (tokens with is_response) are available, so the importance-ratio "
                       "figure is not drawn.")
    return specs, skipped


# ---------------------------------------------------------------------------------------------- writing
def _title(run: RunData) -> str:
    spec = str(_get(run.manifest, "model", "spec", default="model"))
    return f"divergence-probe report: {Path(spec).name or spec}, {run.kind} run"


def _intro(run: RunData) -> Paragraph:
    infer = _get(run.manifest, "stacks", "infer", "name", default=_get(run.manifest, "load", "infer", default="inference"))
    what = {"compare": "compares", "ablate": "ablates", "generate": "compares, on generated rollouts,"}[run.kind]
    text = (f"This report {what} the same checkpoint run by an inference engine (`{infer}`) and by a training "
            "stack (transformers), fed exactly the same token ids. Both compute in the same dtype, yet they round "
            "intermediate results at different places, so the policy that samples and the policy that is trained "
            "differ slightly; the report shows where the two first differ, how the difference grows through the "
            "layers, and what it does to token logprobs.")
    if run.is_ablate:
        text += (" The ablation reruns the comparison with regions (RoPE, SwiGLU, residual RMSNorm) computed in "
                 "FP32 until their output, in every combination, and attributes the mismatch to them.")
    return Paragraph(text + f" Run folder: {_code(run.path.name)}.")


def build_document(run: RunData, figure_specs: list[FigureSpec], skipped: list[str]) -> list:
    blocks: list = [Heading(_title(run), 1), _intro(run)]
    blocks += _setup(run) + _headline(run) + _first_divergence(run) + _tables(run)
    blocks.append(Heading("Figures"))
    if figure_specs:
        blocks.append(Paragraph("Each figure is also saved as a vector PDF beside its PNG in `figures/`."))
    blocks += [Paragraph(s) for s in skipped]
    blocks += [Figure(f.stem, f.title, f.caption) for f in figure_specs]
    return blocks


def _render(run: RunData, out: Path, fmt: str) -> None:
    from .reports import figures as F

    specs, skipped = _figure_specs(run)
    for spec in specs:
        fig = spec.draw()
        F.save(fig, out / doc.FIGURE_DIR, spec.stem)
    blocks = build_document(run, specs, skipped)
    title = _title(run)
    if fmt == "md":
        (out / FORMATS["md"]).write_text(doc.to_markdown(blocks), encoding="utf-8")
    elif fmt == "html":
        images = {s.stem: (out / doc.FIGURE_DIR / f"{s.stem}.png").read_bytes() for s in specs}
        (out / FORMATS["html"]).write_text(doc.to_html(blocks, images, title), encoding="utf-8")
    else:
        main, tables = doc.to_latex(blocks, title)
        for name, source in tables.items():
            (out / f"{name}.tex").write_text(source, encoding="utf-8")
        (out / FORMATS["latex"]).write_text(main, encoding="utf-8")


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())


def _is_previous_report(out_dir: Path) -> bool:
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    listed = set(marker.read_text(encoding="utf-8").splitlines()) | {MARKER}
    return all(f in listed for f in _files(out_dir)) and all(
        p.is_dir() or p.is_file() for p in out_dir.rglob("*"))  # no links or special files


@contextmanager
def _report_dir(out_dir: Path):
    """Yield a temporary folder that becomes out_dir when complete. out_dir must be new, empty, or a previous
    report, which is swapped out only after the new one is complete."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir} is a file; choose another --out")
    if not out_dir.exists() or not any(out_dir.iterdir()):
        from .rundir import atomic_dir

        with atomic_dir(out_dir) as tmp:
            yield tmp
        return
    if not _is_previous_report(out_dir):
        raise OutputError(f"{out_dir} already exists and holds files other than a previous report; "
                          "choose another --out or remove it")
    parent = out_dir.absolute().parent
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=parent))
    try:
        yield tmp
        holder = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=parent))
        os.rename(out_dir, holder / out_dir.name)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            os.rename(holder / out_dir.name, out_dir)  # put the previous report back
            raise
        shutil.rmtree(holder, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, fmt: str = "md") -> Path:
    """Render the run folder `run_dir` into `out_dir` (default: run_dir/report); return the main file
    (report.md, report.html or report.tex). Raises ReportError for a bad run folder and OutputError for an
    out_dir that is neither new, empty nor a previous report."""
    if fmt not in FORMATS:
        raise ReportError(f"--format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    run = load_run(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    if out_dir.resolve() == run.path.resolve():
        raise OutputError(f"--out {out_dir} is the run folder itself; choose another --out (default: RUN_DIR/report)")
    with _report_dir(out_dir) as tmp:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; a report is meant to be shared
        _render(run, tmp, fmt)
        (tmp / MARKER).write_text("\n".join(_files(tmp)) + "\n", encoding="utf-8")
    return out_dir / FORMATS[fmt]
