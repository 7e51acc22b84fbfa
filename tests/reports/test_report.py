"""report: run folders written by hand (compare, ablate, generate) rendered as md, html and LaTeX.

No model and no vLLM: the fixtures are small CSVs with the documented columns. One test at the end runs
`compare --report` and `ablate --report` on the tiny checkpoint through transformers on both sides.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import re
import shutil
from pathlib import Path

import matplotlib
import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.errors import OutputError, ProbeError
from divergence_probe.reports import MARKER, ReportError, write_report
from divergence_probe.reports import figures
from divergence_probe.reports.document import sig, tex_escape, tex_number
from divergence_probe.numerics.noise_verdict import FLOOR_PROMPT_COLUMNS, floor_columns
from divergence_probe.numerics.shapley import MIN_PROMPTS
from divergence_probe.numerics.tables import NOISE_FLOORS
from divergence_probe.numerics.rl_metrics import ratio_split
from divergence_probe.numerics.shapley import ALL_REGIONS, CHANGE, SHARE, change_words
from divergence_probe.numerics.shapley import attribution as shapley_attribution

runner = CliRunner()
N_LAYERS = 4
TAPS = ("input_norm", "q_rope", "k_rope", "attn_core", "attn_out", "resid_mid", "post_norm", "swiglu",
        "mlp_out", "resid_out")
TOKEN_FIGURES = ("delta_hist", "delta_vs_prob", "kl_by_position")


# ---------------------------------------------------------------------------------------------- fixtures
def _manifest(**extra) -> dict:
    manifest = {
        "command": ["divergence-probe", "compare", "--model", "tiny"],
        "compare": {"max_prompt_tokens": None, "num_prompts": 3, "prompts": "/x/sample_prompts",
                    "taps": list(TAPS), "threshold": 0.001},
        "environment": {"cpu": "Test CPU", "gpu": None, "python": "3.12.3", "platform": "Linux-test"},
        "load": {"batch_tokens": 8192, "device": "cpu", "dtype": "bfloat16", "infer": "vllm", "seed": 0,
                 "train": "hf", "train_attn": "sdpa"},
        "model": {"arch": "qwen3", "config_sha256": "ab" * 32, "num_layers": N_LAYERS, "path": "/m/tiny",
                  "spec": "/m/tiny"},
        "stacks": {
            "infer": {"name": "vllm", "versions": {"torch": "2.13.0+cpu", "vllm": "0.32.0"},
                      "implementations": {"rope": "RotaryEmbedding.forward_cpu", "rmsnorm": "RMSNorm.forward_cpu",
                                          "swiglu": "SiluAndMul.forward_cpu"},
                      "settings": {"enforce_eager": True}},
            "train": {"name": "hf", "versions": {"torch": "2.13.0+cpu", "transformers": "5.19.0"},
                      "implementations": {"rope": "apply_rotary_pos_emb", "rmsnorm": "Qwen3RMSNorm.forward",
                                          "swiglu": "Qwen3MLP.forward"}},
        },
    }
    manifest.update(extra)
    return manifest


def _tokens(rng, scale: float, n_prompts: int = 3, length: int = 40, generate: bool = False) -> pd.DataFrame:
    rows = []
    for prompt in range(n_prompts):
        for sample in range(2 if generate else 1):
            for pos in range(1, length):
                logp = -float(rng.exponential(3.0)) - 1e-3
                delta = float(rng.normal(0, scale)) if scale else 0.0
                row = {"prompt_id": prompt, "position": pos, "token_id": int(rng.integers(0, 500)),
                       "token": "NaN" if pos == 3 else f"t{pos}",  # a token string pandas would read as NaN
                       "logprob_infer": logp, "logprob_train": logp + delta, "delta_logprob": delta,
                       "kl": abs(float(rng.normal(0, scale**2))) if scale else 0.0}
                if generate:
                    row = {"prompt_id": prompt, "sample_id": sample, **{k: v for k, v in row.items() if k != "prompt_id"},
                           "is_response": pos >= 10}
                rows.append(row)
    return pd.DataFrame(rows)


def _layers(rng, scale: float) -> pd.DataFrame:
    rows = [{"layer": -1, "tap": "embed", "max_abs": 0.0, "mean_abs": 0.0, "rel_l2": 0.0, "cosine": 1.0,
             "frac_equal": 1.0, "max_ulp": 0}]
    for layer in range(N_LAYERS):
        for i, tap in enumerate(TAPS):
            rel = scale * (1 + layer) * (1 + 0.1 * i) * float(rng.uniform(0.9, 1.1)) if scale else 0.0
            rows.append({"layer": layer, "tap": tap, "max_abs": 10 * rel, "mean_abs": rel / 10, "rel_l2": rel,
                         "cosine": 1 - rel**2, "frac_equal": 1.0 if rel == 0 else 0.5, "max_ulp": 3 if rel else 0})
    rows.append({"layer": N_LAYERS, "tap": "logits", "max_abs": 0.1, "mean_abs": 0.01, "rel_l2": 0.002 if scale else 0.0,
                 "cosine": 1.0, "frac_equal": 0.2, "max_ulp": 5})
    return pd.DataFrame(rows)


def _summary(tokens: pd.DataFrame, first: str) -> dict:
    a = tokens["delta_logprob"].abs()
    return {"mean_abs_dlogp": float(a.mean()), "max_abs_dlogp": float(a.max()),
            "p99_abs_dlogp": float(np.percentile(a, 99)), "mean_kl": float(tokens["kl"].mean()),
            "max_kl": float(tokens["kl"].max()), "first_inexact": first, "first_over_threshold": first,
            "n_tokens": len(tokens)}


def _write(path: Path, manifest: dict, tables: dict, tokens: pd.DataFrame | None, tokens_as: str = "csv") -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (path / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt_id": i, "source": f"p.txt:{i}", "text": "x", "token_ids": [1, 2], "truncated": False}) + "\n"
        for i in range(3)))
    for name, df in tables.items():
        df.to_csv(path / f"{name}.csv", index=False, lineterminator="\n")
    if tokens is not None:
        text = tokens.to_csv(index=False, lineterminator="\n")
        if tokens_as == "gz":
            (path / "tokens.csv.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
        else:
            (path / "tokens.csv").write_text(text)
    return path


def make_compare(path: Path, zero: bool = False, tokens_as: str | None = "csv") -> Path:
    rng = np.random.default_rng(1)
    scale = 0.0 if zero else 0.01
    tokens = _tokens(rng, scale)
    summary = _summary(tokens, "none" if zero else "q_rope@0")
    return _write(path, _manifest(), {"layers": _layers(rng, scale), "summary": pd.DataFrame([summary])},
                  tokens if tokens_as else None, tokens_as or "csv")


REGIONS = ("rope", "swiglu")
COMBOS = {"none": 1.0, "rope": 0.9, "swiglu": 0.97, "rope+swiglu": 0.8}


def make_ablate(path: Path, with_tokens: bool = True, combos: dict = COMBOS, n_prompts: int = 3) -> Path:
    rng = np.random.default_rng(2)
    tokens, layers, summary, ablation = [], [], [], []
    for combo, factor in combos.items():
        t = _tokens(rng, 0.01 * factor, n_prompts=n_prompts)
        tokens.append(t.assign(combo=combo))
        layers.append(_layers(rng, 0.01 * factor).assign(combo=combo))
        s = _summary(t, "input_norm@0" if combo == "none" else "attn_core@1")
        summary.append({"combo": combo, **s})
        ablation.append({"combo": combo, **{r: r in combo.split("+") for r in REGIONS}, **s})
    lead = lambda frames: (lambda df: df[["combo", *[c for c in df.columns if c != "combo"]]])(pd.concat(frames))  # noqa: E731
    m = {c["combo"]: c["mean_kl"] for c in summary}
    attribution = shapley_attribution({frozenset(k.split("+")) if k != "none" else frozenset(): v
                                       for k, v in m.items()}, REGIONS)
    spread = attribution[CHANGE].abs() * [0.2, 1.3, 0.1]  # swiglu's interval contains 0
    attribution["ci_low"], attribution["ci_high"] = attribution[CHANGE] - spread, attribution[CHANGE] + spread
    attribution["share_ci_low"] = attribution["ci_low"] / m["none"]
    attribution["share_ci_high"] = attribution["ci_high"] / m["none"]
    manifest = _manifest(ablate={"regions": list(REGIONS), "side": "both", "metric": "mean_kl", "bootstrap": 100,
                                 "seed": 0, "combos": list(combos)})
    manifest["compare"]["num_prompts"] = n_prompts
    return _write(path, manifest, {"layers": lead(layers), "summary": pd.DataFrame(summary),
                                   "ablation": pd.DataFrame(ablation), "attribution": attribution},
                  lead(tokens) if with_tokens else None)


def make_generate(path: Path, clip_eps: float = 0.01) -> Path:
    """Generate mode as docs/reference/generate-mode.md ("Reading the RL metrics") describes it: headline columns on
    response tokens, RL columns, buckets.csv, and the noise floor (batch_invariance.csv)."""
    rng = np.random.default_rng(3)
    tokens = _tokens(rng, 0.01, generate=True)
    # the engine's prefill near the trainer, far from its own decode: prefill_vs_decode dominates
    tokens.insert(tokens.columns.get_loc("logprob_train"), "logprob_prefill",
                  tokens["logprob_train"] + rng.normal(0, 0.002, len(tokens)))
    response = tokens[tokens["is_response"]]
    rho = np.exp(response["delta_logprob"])
    decode = response["logprob_infer"]
    split = ratio_split({"train": response["logprob_train"], "prefill": response["logprob_prefill"],
                         "decode": decode, "recorded": decode})
    summary = {**_summary(response, "q_rope@0"), "prompt_mean_abs_dlogp": 0.01, "prompt_mean_kl": 1e-4,
               "k3": float(((rho - 1) - response["delta_logprob"]).mean()), "ratio_mean": float(rho.mean()),
               "ratio_unknown_stat": 1.5,
               "ppo_clip_frac": float(((rho < 1 - clip_eps) | (rho > 1 + clip_eps)).mean()), "ess": 0.999,
               "n_response_tokens": len(response), "n_sequences": 6,
               "noise_infer_mean_abs_dlogp": 0.002, "noise_train_mean_abs_dlogp": 0.004, **split}
    buckets = pd.DataFrame({"group": "p_infer", "bucket": ["[0, 0.001)", "[0.001, 0.01)", "[0.9, 1]"],
                            "n_tokens": [10, 0, 30], "mean_kl": [1e-4, None, 1e-5],
                            "mean_abs_dlogp": [0.02, None, 0.001], "ess": [0.99, None, 0.999]})
    noise = pd.DataFrame({"stack": ["vllm", "hf"], "side": ["infer", "train"], "mean_abs_dlogp": [0.002, 0.004],
                          "max_abs_dlogp": [0.01, 0.02], "mean_kl": [1e-5, 2e-5], "max_kl": [1e-4, 2e-4],
                          "n_tokens": [234, 234], "batch_size": [6, 6]})
    manifest = _manifest(generate={"clip_eps": clip_eps, "max_new_tokens": 30, "samples_per_prompt": 2})
    return _write(path, manifest, {"layers": _layers(rng, 0.01), "summary": pd.DataFrame([summary]),
                                   "buckets": buckets, "batch_invariance": noise}, tokens)


MAKERS = {"compare": make_compare, "ablate": make_ablate, "generate": make_generate}


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".") and (".partial-" in p.name or ".old-" in p.name)]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """rendered(kind, fmt) -> main file of the default report of a fresh fixture run, made once per module
    (a render takes a second or two). Tests must not change these folders."""
    cache: dict = {}

    def get(kind: str, fmt: str = "md") -> Path:
        if (kind, fmt) not in cache:
            cache[kind, fmt] = write_report(MAKERS[kind](tmp_path_factory.mktemp(f"{kind}-{fmt}") / "run"), fmt=fmt)
        return cache[kind, fmt]

    return get


# ---------------------------------------------------------------------------------------------- rendering
@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("fmt", ["md", "html", "latex"])
def test_every_run_type_in_every_format(kind, fmt, rendered):
    main = rendered(kind, fmt)
    out = main.parent
    assert main == out / {"md": "report.md", "html": "report.html", "latex": "report.tex"}[fmt] and main.is_file()
    stems = {"layers", *TOKEN_FIGURES} | ({"attribution"} if kind == "ablate" else set()) \
        | ({"ratio_hist"} if kind == "generate" else set())
    if fmt == "html":  # self-contained: every figure embedded, nothing written beside the page
        text = main.read_text()
        assert sorted(p.name for p in out.iterdir()) == [MARKER, "report.html"]
        embedded = re.findall(r'<figure id="figure-([^"]+)">\n<img alt="[^"]*" src="data:image/png;base64,([^"]+)"',
                              text)
        assert {stem for stem, _ in embedded} == stems and 'src="figures/' not in text and "figures/" not in text
        for _, data in embedded:
            image = mpimg.imread(io.BytesIO(base64.b64decode(data)), format="png")
            assert image.shape[:2] == (figures.PIXELS[1], figures.PIXELS[0]) and image[..., :3].std() > 0.01
        return
    assert {p.name for p in (out / "figures").iterdir()} == {f"{s}.{e}" for s in stems for e in ("png", "pdf")}
    for stem in stems:
        image = mpimg.imread(out / "figures" / f"{stem}.png")
        assert image.shape[:2] == (figures.PIXELS[1], figures.PIXELS[0])
        assert image[..., :3].std() > 0.01  # something is drawn, not a blank canvas
        assert (out / "figures" / f"{stem}.pdf").read_bytes().startswith(b"%PDF")
    if fmt == "md":
        text = main.read_text()
        assert all(f"](figures/{s}.png)" in text for s in stems)
    else:
        tables = {"summary", "implementations"} | ({"ablation", "attribution"} if kind == "ablate" else set()) \
            | ({"buckets", "batch_invariance"} if kind == "generate" else set())
        assert {p.stem for p in out.glob("*.tex")} == tables | {"report"}
        text = main.read_text()
        assert not re.search(r"[^\x00-\x7f]", text), "plain pdflatex must compile it: ASCII only"
        assert _balanced(text) and all(_balanced((out / f"{t}.tex").read_text()) for t in tables)
        assert all(f"\\input{{{t}.tex}}" in text for t in tables)
        assert all(f"figures/{s}.pdf" in text for s in stems)
        assert text.count("\\begin{") == text.count("\\end{")
        for t in tables:
            body = (out / f"{t}.tex").read_text()
            assert "\\toprule" in body and "\\midrule" in body and "\\bottomrule" in body
            assert not re.search(r"[^\x00-\x7f]", body), "LaTeX tables must be plain ASCII"


def test_markdown_tells_setup_headline_and_first_divergence(rendered):
    main = rendered("compare")
    run, text = main.parent.parent, main.read_text()
    summary = pd.read_csv(run / "summary.csv").iloc[0]
    assert "First divergence" in text and "`q_rope@0`" in text and "decoder layer 0" in text
    assert f"**{sig(summary['mean_abs_dlogp'])}**" in text and f"**{sig(summary['mean_kl'])}**" in text
    assert "bfloat16" in text and "`vllm`" in text and "0.32.0" in text and "3 prompts" in text
    assert "RotaryEmbedding.forward_cpu" in text and "Seed: `0`" in text
    assert "no tokens.csv" not in text


def test_ablation_markdown_sorted_by_metric_and_explains_attribution(rendered):
    main = rendered("ablate")
    run, text = main.parent.parent, main.read_text()
    table = text.split("sorted by `mean_kl`")[1].split("\n\n")[1]
    combos = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
    expected = pd.read_csv(run / "ablation.csv").sort_values("mean_kl", kind="stable")["combo"].tolist()
    assert combos == expected
    assert "How to read the attribution" in text and f"`{ALL_REGIONS}`" in text
    assert "With every region aligned (`rope+swiglu`)" in text


def test_generate_report_draws_ratio_with_manifest_clip_band(rendered):
    main = rendered("generate")  # clip_eps 0.01
    run, text = main.parent.parent, main.read_text()
    tokens = pd.read_csv(run / "tokens.csv")
    rho = np.exp(tokens.loc[tokens["is_response"], "delta_logprob"])
    outside = int(((rho < 0.99) | (rho > 1.01)).sum())
    assert f"On the {len(rho)} response tokens" in text and f"{outside} tokens" in text
    assert "[0.99, 1.01] (ε = 0.01)" in text
    assert f"Over {len(rho)} response tokens (6 sampled responses)" in text
    assert "| `ppo_clip_frac` |" in text and "| `ratio_unknown_stat` | 1.5 | importance-ratio statistic" in text
    assert "1 empty buckets left out" in text and "[0.001, 0.01)" not in text  # the empty bucket
    assert "Noise floor" in text and "| `hf` | `train` | 0.004 |" in text
    assert (run / "report" / "figures" / "ratio_hist.png").is_file()


def test_generate_report_says_which_factor_of_the_ratio_dominates(rendered):
    main = rendered("generate")
    summary = pd.read_csv(main.parent.parent / "summary.csv").iloc[0]
    assert summary["dominant_factor"] == "prefill_vs_decode"
    text = main.read_text()
    line = next(line for line in text.splitlines() if line.startswith("Per response token the importance ratio"))
    assert f"mean |log| {sig(summary['prefill_vs_decode_mean_abs_dlogp'])} nats" in line
    assert "The largest is the engine's prefill against its own decode path" in line
    assert "aligning the stacks' rounding alone will not close the gap" in line
    engine, every = (f"{sig(summary[f + '_mean_abs_dlogp'] / floor)}×" for f, floor in
                     (("prefill_vs_decode", 0.002), ("train_vs_prefill", 0.004)))
    assert f"Factor `prefill_vs_decode` beside the largest engine noise floor (the inference stack's own batch " \
           f"change, 0.002 nats): {engine}" in line
    assert f"Factor `train_vs_prefill` beside the largest noise floor (the training stack's own batch change, " \
           f"0.004 nats): {every}" in line
    assert "| `dominant_factor` | `prefill_vs_decode` | the factor of π_train/π_recorded" in text


def test_generate_without_clip_eps_uses_default(tmp_path):
    run = make_generate(tmp_path / "run")
    manifest = json.loads((run / "manifest.json").read_text())
    del manifest["generate"]["clip_eps"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert "[0.8, 1.2] (ε = 0.2)" in write_report(run).read_text()


def _floor_prompts(tokens: pd.DataFrame, summary: dict) -> pd.DataFrame:
    """Each floor of `summary` spread evenly over the prompts of `tokens`, as compare's per-prompt floor sums."""
    n = tokens.groupby("prompt_id").size()
    return pd.concat([pd.DataFrame({"floor": name, "prompt_id": n.index, "n": n.values, "sum_abs_dlogp": summary[name] * n.values})
                      for name in NOISE_FLOORS if name in summary] or [pd.DataFrame(columns=FLOOR_PROMPT_COLUMNS)])


def _noise_floor_paragraph(tmp_path, **noise) -> str:
    rng = np.random.default_rng(2)
    tokens = _tokens(rng, 0.01, n_prompts=MIN_PROMPTS)
    summary = {**_summary(tokens, "q_rope@0"), **noise}
    # the ratio's interval and verdict, as compare writes them
    summary |= floor_columns(tokens, summary, 0, _floor_prompts(tokens, summary))
    manifest = _manifest()
    manifest["compare"]["num_prompts"] = MIN_PROMPTS
    run = _write(tmp_path / "run", manifest, {"layers": _layers(rng, 0.01), "summary": pd.DataFrame([summary])},
                 tokens)
    text = write_report(run).read_text()
    return next(line for line in text.splitlines() if line.startswith(("Noise floor", "No noise floor")))


def test_the_mismatch_is_read_against_the_largest_noise_floor(tmp_path):
    """The trainer's own kernel change can move its logprobs as much as the whole gap (docs/reference/generate-mode.md,
    "The noise floor"): the report sets the mismatch against the largest floor measured, not against the batch noise
    alone."""
    mismatch = _summary(_tokens(np.random.default_rng(2), 0.01, n_prompts=MIN_PROMPTS), "q_rope@0")["mean_abs_dlogp"]
    kernel = 2 * mismatch
    text = _noise_floor_paragraph(tmp_path / "a", noise_infer_mean_abs_dlogp=0.0, noise_train_mean_abs_dlogp=1e-5,
                                  noise_train_kernel_mean_abs_dlogp=kernel)
    assert ("set against the largest of these floors (the training stack's own attention-kernel change): "
            f"**within the systematic floor: the mismatch is {mismatch / kernel:.3g}x its largest floor (the training "
            "stack's own attention-kernel change, a systematic floor; 95% interval over prompts") in text
    assert "no larger than what that change alone does" in text
    text = _noise_floor_paragraph(tmp_path / "b", noise_infer_engine_mode_mean_abs_dlogp=mismatch / 4,
                                  tap_points_mean_abs_dlogp=0.0)
    assert text.startswith("Noise floor: the engine in its other mode") and "tap points left its logprobs" in text
    assert "floors (the engine's own change of mode): **above the systematic floor: the mismatch is 4x" in text
    assert _noise_floor_paragraph(tmp_path / "c").startswith("No noise floor was measured")


def test_the_terminal_summary_reads_the_mismatch_against_the_largest_noise_floor(monkeypatch, tmp_path):
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from divergence_probe.cli import tables

    def printed(**noise) -> str:
        buffer = io.StringIO()
        monkeypatch.setattr(tables, "out", Console(file=buffer, width=240))
        tokens = _tokens(np.random.default_rng(2), 0.01, n_prompts=MIN_PROMPTS)
        summary = {**_summary(tokens, "q_rope@0"), "mean_abs_dlogp": 0.012, **noise}
        summary |= floor_columns(tokens, summary, 0, _floor_prompts(tokens, summary))
        run = SimpleNamespace(summary=summary, manifest={"load": {"infer": "vllm"}}, threshold=1e-3, tap_stats={},
                              spec=SimpleNamespace(align=SimpleNamespace(regions=())))
        tables.print_summary(run)
        return buffer.getvalue()

    text = printed(noise_infer_mean_abs_dlogp=0.0, noise_train_mean_abs_dlogp=1e-4,
                   noise_train_kernel_mean_abs_dlogp=0.01)
    assert "mismatch / largest floor" in text and "1.2x, 95% CI [" in text
    assert "(the training stack's own attention-kernel change: systematic)" in text and "normal or not" in text
    text = printed(noise_infer_engine_mode_mean_abs_dlogp=0.024, tap_points_mean_abs_dlogp=0.0)
    assert "0.5x, 95% CI [" in text and "(the engine's own change of mode: systematic)" in text
    assert "engine with vs without tap points" in text
    assert "not measured (--batch-invariance, --engine-noise)" in printed()


def test_every_noise_floor_column_the_tool_writes_has_a_meaning():
    from divergence_probe.runs.batch_invariance import TAP_POINTS_CHANGE
    from divergence_probe.runs.compare import noise_floor_columns
    from divergence_probe.reports.tables import SUMMARY_MEANINGS
    from divergence_probe.numerics.tables import NOISE_FLOORS

    floor = pd.DataFrame({"side": ["infer", "train"], "mean_abs_dlogp": [0.0, 1e-4]})
    kernel = pd.DataFrame({"change": ["sdpa math vs auto", "train_tp 1 vs 2"], "mean_abs_dlogp": [1e-2, 3e-3]})
    engine = pd.DataFrame({"change": ["engine eager vs compiled", f"{TAP_POINTS_CHANGE} vs with"],
                           "mean_abs_dlogp": [1e-2, 0.0]})
    columns = noise_floor_columns(floor, kernel, engine)
    assert len(columns) == 6 and set(columns) <= set(SUMMARY_MEANINGS)
    assert columns["noise_train_kernel_mean_abs_dlogp"] == 1e-2
    assert columns["noise_train_tensor_parallel_mean_abs_dlogp"] == 3e-3
    assert set(columns) - set(NOISE_FLOORS) == {"tap_points_mean_abs_dlogp"}
    parallel = noise_floor_columns(None, None, pd.DataFrame({"change": ["tensor_parallel_size 1 vs 2"],
                                                             "mean_abs_dlogp": [2e-3]}))
    assert parallel == {"noise_infer_tensor_parallel_mean_abs_dlogp": 2e-3} and set(parallel) <= set(NOISE_FLOORS)
    assert set(parallel) <= set(SUMMARY_MEANINGS)


def test_bootstrap_level_comes_from_the_manifest(rendered, tmp_path):
    assert "95% bootstrap interval" in rendered("ablate").read_text()  # manifests without ci_level: 0.95
    run = make_ablate(tmp_path / "run")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["ablate"]["ci_level"] = 0.9
    (run / "manifest.json").write_text(json.dumps(manifest))
    text = write_report(run).read_text()
    assert text.count("90% bootstrap interval") == 2 and "90% percentile bootstrap interval" in text
    assert "95%" not in text
    bars = figures.attribution_bars(pd.read_csv(run / "attribution.csv"), "mean_kl", "90%")
    assert bars.axes[0].get_title().endswith("(whiskers: 90% bootstrap interval)")


# ---------------------------------------------------------------------------------------------- LaTeX numbers
def _tex_rows(path: Path) -> list[list[str]]:
    body = path.read_text().split("\\midrule\n")[1].split("\\bottomrule")[0]
    return [[c.strip() for c in line.rstrip(" \\").split(" & ")] for line in body.strip().splitlines()]


def _number(cell: str) -> float:
    percent = cell.endswith("\\%")
    m = re.fullmatch(r"\$(-?[\d.]+)(?:\\times 10\^\{(-?\d+)\})?\$|\$10\^\{(-?\d+)\}\$", cell.removesuffix("\\%"))
    assert m, cell
    value = 10.0 ** int(m.group(3)) if m.group(3) else float(m.group(1)) * 10.0 ** int(m.group(2) or 0)
    return value / 100 if percent else value


def _rounded(x: float, percent: bool = False) -> float:
    return float(sig(100 * x)) / 100 if percent else float(sig(x))


def test_latex_tables_hold_the_csv_numbers_after_rounding(rendered):
    out = rendered("ablate", "latex").parent
    run = out.parent

    attribution = pd.read_csv(run / "attribution.csv")
    rows = _tex_rows(out / "attribution.tex")
    assert [r[0] for r in rows] == [f"\\texttt{{{r}}}" for r in attribution["region"]]
    for row, (_, expected) in zip(rows, attribution.iterrows()):
        columns = [CHANGE, SHARE, "share_ci_low", "share_ci_high", "main_effect_change", "leave_one_out_change",
                   "ci_low", "ci_high"]
        assert len(row) == 1 + len(columns)
        for cell, col in zip(row[1:], columns):
            if pd.isna(expected[col]):
                assert cell == "--"
            else:
                assert _number(cell) == pytest.approx(_rounded(expected[col], "share" in col), rel=1e-12)

    ablation = pd.read_csv(run / "ablation.csv").sort_values("mean_kl", kind="stable")
    rows = _tex_rows(out / "ablation.tex")
    header = (out / "ablation.tex").read_text().split("\\toprule\n")[1].split(" \\\\")[0].split(" & ")
    header = [h.replace("\\_", "_") for h in header]
    assert header[:4] == ["combo", "rope", "swiglu", "mean_kl"]
    for row, (_, expected) in zip(rows, ablation.iterrows()):
        assert row[0] == f"\\texttt{{{expected['combo']}}}"
        assert row[1:3] == ["yes" if expected[r] else "no" for r in REGIONS]
        for cell, col in zip(row, header):
            if col in ("mean_kl", "mean_abs_dlogp", "max_abs_dlogp", "p99_abs_dlogp", "max_kl"):
                assert _number(cell) == pytest.approx(_rounded(expected[col]), rel=1e-12)

    summary = pd.read_csv(run / "summary.csv").set_index("combo")
    for row in _tex_rows(out / "summary.tex"):
        quantity = row[0].removeprefix("\\texttt{").removesuffix("}").replace("\\_", "_")
        for cell, combo in zip(row[1:3], ["none", "rope+swiglu"]):
            value = summary.loc[combo, quantity]
            if quantity == "n_tokens":
                assert cell == f"${value}$"
            elif isinstance(value, str):
                assert cell == f"\\texttt{{{value.replace('_', chr(92) + '_')}}}"
            else:
                assert _number(cell) == pytest.approx(_rounded(value), rel=1e-12)


def test_sig_and_tex_number():
    assert [sig(x) for x in (0.0, -0.0, 0.02352652, 0.000437197, 3.893786e-05, 10132.0, -0.0155706)] == [
        "0", "0", "0.0235", "0.000437", "3.89e-05", "1.01e+04", "-0.0156"]
    assert tex_number("3.89e-05") == r"$3.89\times 10^{-5}$" and tex_number("1e-05") == r"$10^{-5}$"
    assert tex_number("-0.0156") == "$-0.0156$" and tex_number("81.3%") == r"$81.3$\%"
    assert tex_escape("Σρ 5$ a_b {x} ‖é") == r"$\Sigma\rho$ 5\$ a\_b \{x\} $\|$e"


def _balanced(tex: str) -> bool:
    """Braces nest and math shifts pair up, once escaped characters (\\{ \\$ ...) are set aside."""
    plain, depth = re.sub(r"\\[{}$%&#_]", "", tex), 0
    for ch in plain:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0 and plain.count("$") % 2 == 0


# ---------------------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("fmt", ["md", "html", "latex"])
def test_two_renders_are_byte_identical(fmt, rendered, tmp_path):
    first = rendered("ablate", fmt).parent
    matplotlib.rcParams["lines.linewidth"] = 7  # the caller's style must not leak into the figures
    try:
        write_report(first.parent, tmp_path / "again", fmt=fmt)
    finally:
        matplotlib.rcdefaults()
    a, b = files(first), files(tmp_path / "again")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), [k for k in a if a[k] != b.get(k)]


def test_gzipped_tokens_render_like_plain_tokens(rendered, tmp_path):
    run = make_compare(tmp_path / "run", tokens_as="gz")
    assert (run / "tokens.csv.gz").is_file() and not (run / "tokens.csv").exists()
    write_report(run)
    a, b = files(rendered("compare").parent), files(run / "report")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def test_figures_keep_no_timestamps_or_versions(rendered):
    out = rendered("compare").parent
    pdf = (out / "figures" / "layers.pdf").read_bytes()
    png = (out / "figures" / "layers.png").read_bytes()
    assert b"CreationDate" not in pdf and b"Producer" not in pdf and b"matplotlib" not in pdf.lower()
    assert b"Software" not in png and b"matplotlib" not in png.lower()


def test_subsampling_is_deterministic_and_bounded():
    a, b = figures.subsample(100_000, 500), figures.subsample(100_000, 500)
    assert (a == b).all() and len(a) == 500 and (np.diff(a) > 0).all()
    assert (figures.subsample(10, 500) == np.arange(10)).all()


# ---------------------------------------------------------------------------------------------- edge cases
def test_ablate_without_tokens_skips_token_figures_and_says_so(tmp_path):
    run = make_ablate(tmp_path / "run", with_tokens=False)
    text = write_report(run).read_text()
    assert "no tokens.csv" in text
    assert {p.stem for p in (run / "report" / "figures").iterdir()} == {"layers", "attribution"}


def test_zero_baseline_renders_and_says_bitwise_equal(tmp_path):
    run = make_compare(tmp_path / "run", zero=True)
    text = write_report(run).read_text()
    assert "exactly 0" in text and "bitwise equal" in text
    assert (run / "report" / "figures" / "delta_vs_prob.png").is_file()


def test_all_zero_series_draw_on_any_axes(tmp_path):
    """transformers on both sides gives exact zeros, which log axes cannot show: every figure still renders."""
    logp, zeros = -np.linspace(0.1, 9, 50), np.zeros(50)
    frame = pd.DataFrame({"seq": 0, "x": np.arange(50), "kl": zeros})
    layers = pd.DataFrame({"combo": "none", "layer": np.arange(4), "tap": "resid_out", "rel_l2": 0.0})
    drawn = {
        "vs_prob": figures.delta_vs_probability([("a", logp, zeros), ("b", logp, zeros)]),
        "mixed": figures.delta_vs_probability([("a", logp, zeros), ("b", logp, zeros + 1e-3)]),
        "hist": figures.delta_histogram([("a", zeros), ("b", zeros)]),
        "kl": figures.kl_by_position([("t", "x", [("a", frame), ("b", frame)]), ("u", "x", [("c", frame)])]),
        "layers": figures.layer_growth(layers, ("resid_out",), combos=("none",)),
        "ratio": figures.ratio_histogram(np.ones(50), 0.2),
    }
    for stem, fig in drawn.items():
        png, pdf = figures.save(fig, tmp_path, stem)
        assert png.stat().st_size > 0 and pdf.stat().st_size > 0


def test_taps_none_run_has_no_layer_figure(tmp_path):
    run = make_compare(tmp_path / "run")
    pd.DataFrame(columns=["layer", "tap", "max_abs", "mean_abs", "rel_l2", "cosine", "frac_equal", "max_ulp"]).to_csv(
        run / "layers.csv", index=False)
    summary = pd.read_csv(run / "summary.csv").assign(first_inexact="not captured", first_over_threshold="not captured")
    summary.to_csv(run / "summary.csv", index=False)
    text = write_report(run).read_text()
    assert "`--taps none`" in text and not (run / "report" / "figures" / "layers.png").exists()


LEGACY_RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_runs"


@pytest.mark.parametrize("name", ["ablate-both", "generate"])
def test_real_h200_runs_render(name, tmp_path):
    """Runs the tool wrote on a GPU (cut to two prompts): no tokens file (ablate), tokens.csv.gz with every RL
    column (generate)."""
    run = LEGACY_RUNS / name
    text = write_report(run, tmp_path / "out").read_text()
    assert "`input_norm@0`" in text and "NVIDIA H200" in text
    assert ("no tokens.csv" in text) == name.endswith("ablate-both")
    assert ("ratio_hist.png" in text) == name.endswith("generate")


# ---------------------------------------------------------------------------------------------- output folder
def test_rerender_replaces_a_previous_report_only(tmp_path):
    run = make_compare(tmp_path / "run")
    write_report(run)
    out = run / "report"
    (out / "report.md").write_text("stale")
    write_report(run, fmt="html")  # replaces the md report: the folder held exactly a previous report
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "report.html"]
    assert not leftovers(run)

    (out / "notes.txt").write_text("mine")
    before = files(out)
    with pytest.raises(OutputError, match="other than a previous report"):
        write_report(run)
    assert files(out) == before and not leftovers(run)


def test_out_dir_must_be_new_empty_or_a_report(tmp_path):
    run = make_compare(tmp_path / "run")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "data.csv").write_text("x")
    with pytest.raises(OutputError):
        write_report(run, busy)
    with pytest.raises(OutputError):
        write_report(run, run)  # the run folder itself
    (tmp_path / "empty").mkdir()
    assert write_report(run, tmp_path / "empty") == tmp_path / "empty" / "report.md"
    assert not leftovers(tmp_path)


def test_failed_render_leaves_the_previous_report(tmp_path, monkeypatch):
    run = make_compare(tmp_path / "run")
    write_report(run)
    before = files(run / "report")
    monkeypatch.setattr(figures, "kl_by_position", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        write_report(run)
    assert files(run / "report") == before and not leftovers(run)


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("file", "is a file"),
    ("empty", "not a divergence-probe run folder"),
    ("no_summary", "no summary.csv"),
    ("bad_json", "cannot read"),
    ("bad_summary", "cannot read"),
    ("bad_tokens", "lacks the column"),
])
def test_bad_run_folder_is_a_probe_error(case, message, tmp_path):
    run = tmp_path / "run"
    if case == "file":
        run.write_text("x")
    elif case == "empty":
        run.mkdir()
    elif case != "missing":
        make_compare(run)
        if case == "no_summary":
            (run / "summary.csv").unlink()
        elif case == "bad_json":
            (run / "manifest.json").write_text("{not json")
        elif case == "bad_summary":
            (run / "summary.csv").write_bytes(b"")
        elif case == "bad_tokens":
            (run / "tokens.csv").write_text("prompt_id,position\n0,1\n")
    with pytest.raises(ReportError, match=message) as info:
        write_report(run)
    assert isinstance(info.value, ProbeError)
    assert not (tmp_path / "run" / "report").exists() or case == "file"


def test_unknown_format_is_a_probe_error(tmp_path):
    with pytest.raises(ProbeError, match="--format"):
        write_report(make_compare(tmp_path / "run"), fmt="pdf")


# ---------------------------------------------------------------------------------------------- CLI
def test_report_cli(tmp_path):
    run = make_compare(tmp_path / "run")
    result = runner.invoke(app, ["report", str(run), "--format", "html", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert f"report: {tmp_path / 'out' / 'report.html'}" in result.output.replace("\n", "")
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0 and (run / "report" / "report.md").is_file()


@pytest.mark.parametrize("args, message", [(["missing"], "does not exist"), (["RUN", "--format", "doc"], "--format")])
def test_report_cli_errors_are_one_line_exit_2(args, message, tmp_path, monkeypatch):
    monkeypatch.delenv("DP_RAISE_ERRORS", raising=False)
    run = make_compare(tmp_path / "run")
    args = [str(tmp_path / a) if a == "missing" else str(run) if a == "RUN" else a for a in args]
    result = runner.invoke(app, ["report", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()) and "Traceback" not in result.output


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_compare_and_ablate_report_flag(qwen3_tiny, prompts_file, tmp_path):
    """transformers on both sides (no vLLM): an all-zero run, rendered right after it is written."""
    common = ["--model", str(qwen3_tiny), "--prompts", str(prompts_file), "--infer", "hf", "--device", "cpu"]
    result = runner.invoke(app, ["compare", *common, "--out", str(tmp_path / "c"), "--report"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = (tmp_path / "c" / "report" / "report.md").read_text()
    assert "exactly 0" in text and "report.md" in result.output.replace("\n", "")
    result = runner.invoke(app, ["ablate", *common, "--regions", "rope", "--bootstrap", "10",
                                 "--out", str(tmp_path / "a"), "--report"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "a" / "report" / "figures" / "attribution.png").is_file()
    shutil.rmtree(tmp_path / "a" / "report")


# ---------------------------------------------------------------------------------------------- MoE routing
MOE = Path(__file__).resolve().parents[1] / "fixtures" / "moe_runs"


def _moe_copy(name: str, tmp_path: Path) -> Path:
    """A copy of an H200 Qwen3-30B-A3B run folder (24 layers; its layers and prompts cut to two, tokens.csv left
    out), so nothing is written beside the original."""
    run = MOE / name
    return Path(shutil.copytree(run, tmp_path / name))


def _routing_section(main: Path) -> str:
    return main.read_text().split("\n## Routing\n")[1].split("\n## ")[0]


def _pct(x: float) -> str:
    return sig(100 * x) + "%"


def _md_rows(section: str) -> list[list[str]]:
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]  # lines[0] is the header


def test_a_moe_run_renders_the_numbers_of_its_routing_csv(tmp_path):
    run = _moe_copy("shipped", tmp_path)
    routing = pd.read_csv(run / "routing.csv").sort_values("layer")
    noise = pd.read_csv(run / "routing_noise.csv")
    summary = pd.read_csv(run / "summary.csv").iloc[0]
    section = _routing_section(write_report(run, tmp_path / "md"))
    frac = routing["frac_topk_set_differs"]
    assert f"{_pct(frac.min())} to {_pct(frac.max())} of the routed tokens" in section
    flipped = routing["tokens"] * frac  # near ties pooled over layers, weighted by each layer's flipped tokens
    near = routing["frac_flipped_near_tie"]
    pooled = (near * flipped).sum() / flipped[near.notna()].sum()
    assert f"{_pct(pooled)} of the strict order differences" in section
    assert f"**{_pct(summary['frac_tokens_any_flip'])}** of the routed positions" in section
    # a run from before the experts each stack ran were recorded says that its rates are the router logits'
    assert "`frac_topk_set_differs`, the experts picked from their router logits" in section
    floors = {f"noise_{side}_frac_tokens_any_flip": f"the {stack} stack's own batch change"
              for side, stack in (("infer", "inference"), ("train", "training"))}
    for name, change in floors.items():
        assert f"{_pct(summary[name])} under {change}" in section
    largest = max(floors, key=lambda name: summary[name])
    assert (f"flips {sig(summary['frac_tokens_any_flip'] / summary[largest])}× as many positions as the largest "
            f"floor ({floors[largest]}, a noise floor)") in section  # a batch change: noise, not a swap
    assert f"**{sig(summary['mean_abs_dlogp_after_flip'])}** nats, against " \
           f"{sig(summary['mean_abs_dlogp_not_after_flip'])} for the others" in section
    assert "Routes were not replayed" in section

    out = write_report(run, tmp_path / "tex", fmt="latex").parent
    header = (out / "routing.tex").read_text().split("\\toprule\n")[1].split(" \\\\")[0].split(" & ")
    assert [h.replace("\\_", "_") for h in header] == [
        "layer", "frac_topk_set_differs", "frac_flipped_near_tie", "floor: infer (vllm)", "floor: train (hf)"]
    floors = [noise[noise["side"] == side].set_index("layer")["frac_topk_set_differs"] for side in ("infer", "train")]
    rows = _tex_rows(out / "routing.tex")
    assert len(rows) == len(routing)
    for row, r in zip(rows, routing.to_dict("records")):
        assert row[0] == f"${r['layer']}$"
        expected = [r["frac_topk_set_differs"], r["frac_flipped_near_tie"], *(f[r["layer"]] for f in floors)]
        for cell, value in zip(row[1:], expected):
            if pd.isna(value):
                assert cell == "--"
            else:
                assert _number(cell) == pytest.approx(_rounded(value), rel=1e-12)
    assert "\\input{routing.tex}" in (out / "report.tex").read_text() and (out / "figures" / "routing.pdf").is_file()


def test_an_ablation_with_routing_says_what_share_of_the_mismatch_routing_explains(tmp_path):
    run = _moe_copy("ablate", tmp_path)
    attribution = pd.read_csv(run / "attribution.csv").set_index("region").loc["routing"]
    shipped_kl = pd.read_csv(run / "summary.csv").set_index("combo").loc["none", "mean_kl"]
    routing = pd.read_csv(run / "routing.csv")
    section = _routing_section(write_report(run, tmp_path / "md"))
    share = -attribution["shapley"] / shipped_kl  # a folder written before the signed changes, read as one
    # its 16 prompts are fewer than an interval needs: the interval it recorded is not read, nothing is "detected"
    assert share < 0 and f"**{change_words(share)} (no interval)** of the shipped `mean_kl`" in section
    assert change_words(share).startswith("removes ") and f"fewer than the {MIN_PROMPTS}" in section
    assert "interval" not in section.split("(no interval)")[1].split(".")[0]
    assert "Routes are replayed in every combination that aligns `routing`" in section
    # per layer: the shipped block, and the block with every region aligned, whose routers still disagree
    rows = _md_rows(section)
    blocks = [routing[routing["combo"] == c].sort_values("layer")["frac_topk_set_differs"] for c in
              ("none", "rope+rmsnorm+routing")]
    assert len(rows) == len(blocks[0]) and blocks[1].gt(0).any()
    for row, shipped, aligned in zip(rows, *blocks):
        assert (row[1], row[3]) == (sig(shipped), sig(aligned))


@pytest.mark.parametrize("name", ["r3", "ids_weights"])
def test_a_replayed_run_says_which_replay(name, tmp_path):
    from divergence_probe.reports.moe import REPLAYS

    run = _moe_copy(name, tmp_path)
    replay = json.loads((run / "manifest.json").read_text())["compare"]["routing"]["replay"]
    section = _routing_section(write_report(run, tmp_path / "md"))
    assert "Routes were replayed" in section and REPLAYS[replay] in section
    assert all(text not in section for other, text in REPLAYS.items() if other != replay)
    # both stacks ran the engine's experts: a flip is the routers' disagreement, not a token routed differently
    assert "two stacks' routers pick different expert sets" in section
    assert "of the routed tokens of a layer to different expert sets" not in section
    assert "The routers disagree on **" in section and "routes replayed, so no token was routed differently" in section


def test_the_terminal_row_names_the_routers_disagreement_after_replay():
    from rich.console import Console
    from rich.table import Table

    from divergence_probe.cli.tables import routing_rows

    s = {"frac_tokens_any_flip": 0.05, "mean_abs_dlogp_after_flip": 0.1, "mean_abs_dlogp_not_after_flip": 0.01}
    rows = {}
    for replayed in (False, True):
        table = Table()
        routing_rows(table, s, replayed)
        console = Console(width=200, record=True)
        console.print(table)
        rows[replayed] = console.export_text()
    assert "tokens run through other experts" in rows[False] and "routers disagree" not in rows[False]
    assert "routers disagree" in rows[True] and "routes replayed" in rows[True]


@pytest.mark.parametrize("kind", list(MAKERS))
def test_a_dense_run_has_no_routing_section(kind, rendered):
    main = rendered(kind)
    assert "## Routing" not in main.read_text() and not (main.parent / "figures" / "routing.png").exists()


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_a_fresh_tiny_moe_run_has_a_routing_row_per_moe_layer(qwen3_moe_tiny, tmp_path):
    """transformers on both sides agree bitwise, so nothing flips: the section a run of today's tool gets."""
    import divergence_probe as dp

    with dp.load(str(qwen3_moe_tiny), infer="hf", dtype="bfloat16", device="cpu") as probe:
        probe.compare(taps="router_logits", num_prompts=3, max_prompt_tokens=64).write(tmp_path / "run")
    routing = pd.read_csv(tmp_path / "run" / "routing.csv")
    main = write_report(tmp_path / "run", fmt="latex")
    rows = _tex_rows(main.parent / "routing.tex")
    assert [r[0] for r in rows] == [f"${layer}$" for layer in sorted(routing["layer"])]
    header = (main.parent / "routing.tex").read_text().split("\\toprule\n")[1].split(" \\\\")[0].split(" & ")
    header = [h.replace("\\_", "_") for h in header]
    assert header == ["layer", "frac_experts_differ", "frac_differ_tie_collision", "frac_kth_tie_infer",
                      "frac_kth_tie_train", "frac_topk_set_differs", "frac_flipped_near_tie"]
    for r in rows:  # no flips: no tie collision, no near-tie share either; both sides tie alike
        assert (r[1], r[2], r[5], r[6]) == ("$0$", "$0$", "$0$", "--") and r[3] == r[4]
    section = _routing_section(write_report(tmp_path / "run", tmp_path / "md"))
    assert f"same experts in all {len(routing)} MoE layers" in section and "Routes were not replayed" in section
    image = mpimg.imread(main.parent / "figures" / "routing.png")
    assert image[..., :3].std() > 0.01


# ---------------------------------------------------------------------------------------------- verdicts in words
def test_attribution_words_say_adds_and_removes_with_signs_of_the_shipped_value(tmp_path):
    """Aligning both regions adds mismatch while rope removes some: every share keeps its sign (a share of the total
    change would flip both), the words say "removes"/"adds" where the interval excludes 0 and "no detectable effect"
    where it holds 0 (swiglu's here), the all-regions change leads."""
    run = make_ablate(tmp_path / "run", combos={"none": 1.0, "rope": 0.75, "swiglu": 1.4, "rope+swiglu": 1.1},
                      n_prompts=MIN_PROMPTS)
    attribution = pd.read_csv(run / "attribution.csv").set_index("region")
    assert attribution.loc["rope", SHARE] < 0 < attribution.loc["swiglu", SHARE]
    assert attribution.loc[ALL_REGIONS, SHARE] > 0
    text = write_report(run).read_text()
    words = text.split("Aligning every region together")[1].split("\n")[0]
    assert words.startswith(f": **{change_words(attribution.loc[ALL_REGIONS, SHARE])}** of the shipped `mean_kl`")
    assert f"`rope` {change_words(attribution.loc['rope', SHARE])}" in words and "`rope` removes" in words
    swiglu = attribution.loc["swiglu"]
    assert swiglu.share_ci_low < 0 < swiglu.share_ci_high
    assert f"`swiglu` no detectable effect (point {100 * swiglu[SHARE]:+.3g}%" in words and "`swiglu` adds" not in words
    headline = text.split("With every region aligned")[1].split("\n")[0]
    assert "aligning every region adds" in headline


def test_graft_and_depth_findings_name_the_op_and_the_step_that_add_most(tmp_path):
    """local_families sorted by local error with no inf shown, and the step that adds most of the gap in words: the
    final norm here (0.8 -> 0.35 of a 1.0 gap)."""
    run = make_compare(tmp_path / "run")
    pd.DataFrame({"family": ["gemm", "norm", "rope"], "seams": [7, 4, 2], "local_rel_l2": [1e-3, 5e-3, 0.0],
                  "local_frac_equal": [0.5, 0.2, 1.0], "local_max_ulp": [2.0, 4.0, 0.0],
                  "propagated_rel_l2": [3e-3, 6e-3, 2e-3], "amplification": [3.0, 1.2, float("inf")]}
                 ).to_csv(run / "local_families.csv", index=False)
    n = json.loads((run / "manifest.json").read_text())["model"]["num_layers"]
    gap = [1.0 - 0.2 * x / n for x in range(n + 1)] + [0.35]  # the decoder layers 0.2 in all, the final norm 0.45
    pd.DataFrame({"layer": range(n + 2), "graft": ["embed", *(f"resid_out@{x}" for x in range(n)), f"final_norm@{n}"],
                  "mean_abs_dlogp": gap, "max_abs_dlogp": 2.0, "mean_kl": 0.1, "max_kl": 0.2, "n_tokens": 30}
                 ).to_csv(run / "depth.csv", index=False)
    text = write_report(run).read_text()
    assert "Adds most of the gap: the final norm, 45% of the mean |Δlogprob|" in text
    assert "Largest error of its own: op family norm" in text
    table = text.split("Local error per op family")[1].split("\n\n")[1]
    assert [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]] == ["norm", "gemm", "rope"]
    assert "no own error: passes on what it receives" in table and "inf" not in table


def test_the_local_figure_has_one_legend_entry_per_family_beside_the_axes():
    local = pd.DataFrame([{"layer": layer, "family": family, "local_rel_l2": 1e-3 * (i + 1),
                           "propagated_rel_l2": 2e-3 * (i + 1)}
                          for layer in range(3) for i, family in enumerate(("gemm", "norm", "rope", "attention"))])
    fig = figures.local_vs_propagated(local, ("gemm", "attention", "norm", "rope", "swiglu"))
    [ax] = fig.axes
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["gemm", "attention", "norm", "rope", "local (solid)",
                                                          "propagated (dashed)"]
    fig.canvas.draw()
    box, axes_box = legend.get_window_extent(), ax.get_window_extent()
    assert box.x0 >= axes_box.x1  # beside the data, not over it


def test_a_score_runs_figures_name_the_rollout_logprob():
    fig = figures.delta_histogram([("response tokens", np.array([0.1, -0.2]))], "rollout (engine) logprob")
    assert fig.axes[0].get_xlabel() == "Δlogprob = logprob_train − rollout (engine) logprob (nats)"
