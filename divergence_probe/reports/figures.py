"""The report's figures: pure functions from a run's tables to matplotlib Figures, and `save` (PNG + PDF).

    fig = figures.layer_growth(layers, taps=("q_rope", "resid_out"))
    figures.save(fig, out_dir / "figures", "layers")     # layers.png (1200 x 675 px) and layers.pdf

Every figure has the same size, is readable in greyscale (each series differs in line style, marker or hatch,
not only colour) and is byte-identical for identical inputs: no pyplot state, matplotlib's default style
whatever the user's matplotlibrc says, a fixed hash salt, no dates or software versions in the files, and
subsampling with a fixed seed.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path

import matplotlib as mpl
import numpy as np
from matplotlib.ticker import MaxNLocator
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ..numerics.shapley import ALL_REGIONS, SHARE, change_words

FIGSIZE = (8.0, 4.5)  # inches
DPI = 150  # PNG: 1200 x 675 pixels
PIXELS = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))
MAX_POINTS = 20_000  # scatter points per series; more are subsampled with a fixed seed
SEED = 0

PNG_METADATA = {"Software": None}
PDF_METADATA = {"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None}
_RC = {
    "svg.hashsalt": "divergence-probe",
    "path.simplify": False,  # keep every point of a curve; the files stay small at these sizes
    "axes.grid": True,
    "grid.color": "#d9d9d9",
    "grid.linewidth": 0.6,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 8.5,
    "legend.framealpha": 0.9,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
}

# Okabe-Ito colours (colour-blind safe) paired with line styles, markers and hatches that tell series apart
# in greyscale on their own.
COLORS = ("#000000", "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#777777")
LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1.5)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 2, 2, 2)))
MARKERS = ("o", "s", "^", "D", "v", "x", "+", "*")
HATCHES = ("///", "\\\\\\", "...", "xxx", "---", "+++", "ooo", "|||")


def style(i: int) -> dict:
    """Line style of series i: colour, line style and marker all differ, so greyscale prints stay readable."""
    i %= len(COLORS)
    return {"color": COLORS[i], "linestyle": LINESTYLES[i], "marker": MARKERS[i]}


def _styled(fn):
    """Build the figure under matplotlib's default style plus _RC, whatever the caller's rcParams are."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with mpl.rc_context():
            mpl.rcdefaults()
            mpl.rcParams.update(_RC)
            return fn(*args, **kwargs)
    return wrapper


def _new_figure(ncols: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas: no GUI backend, no pyplot registry
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


@_styled
def png_bytes(fig: Figure) -> bytes:
    """The PNG save() writes, in memory: what a self-contained HTML report embeds."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, metadata=PNG_METADATA)
    return buffer.getvalue()


@_styled
def save(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    """Write <stem>.png (150 dpi, fixed pixel size) and <stem>.pdf, both without timestamps or versions."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png, pdf = out_dir / f"{stem}.png", out_dir / f"{stem}.pdf"
    fig.savefig(png, format="png", dpi=DPI, metadata=PNG_METADATA)
    # The layout is in figure fractions and was just computed: keep it for the PDF instead of solving it again
    # (half the rendering time goes to measuring tick labels).
    fig.set_layout_engine("none")
    fig.savefig(pdf, format="pdf", metadata=PDF_METADATA)
    return [png, pdf]


def _positive(values) -> np.ndarray:
    """Values for a log axis: zeros (bitwise-equal results) and negatives become gaps."""
    v = np.asarray(values, dtype=np.float64)
    return np.where(v > 0, v, np.nan)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=10,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "#999999"})


def _count_axis(ax, counts) -> None:
    """Counts on a log axis only when they span more than two decades (tails of thousands of tokens)."""
    counts = np.asarray(counts, dtype=np.float64)
    counts = counts[counts > 0]
    wide = len(counts) and counts.max() / counts.min() > 100
    ax.set_yscale("log" if wide else "linear")
    ax.set_ylabel("tokens (count, log scale)" if wide else "tokens (count)")


def subsample(n: int, limit: int = MAX_POINTS, seed: int = SEED) -> np.ndarray:
    """Sorted indices of at most `limit` of n rows, the same for the same n on every run."""
    if n <= limit:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=limit, replace=False))


# ---------------------------------------------------------------------------------------------- (1) layers
def _layer_lines(ax, curves: list[tuple[str, pd.DataFrame]], title: str) -> None:
    drawn = 0
    for i, (label, df) in enumerate(curves):
        df = df.sort_values("layer")
        y = _positive(df["rel_l2"])
        if np.isnan(y).all():
            label += " (all 0)"
        ax.plot(df["layer"].to_numpy(), y, label=label, linewidth=1.4, markersize=4.5,
                markevery=(i % 3, 3) if len(df) > 12 else None, markerfacecolor="none", **style(i))
        drawn += int(not np.isnan(y).all())
    ax.set_title(title)
    ax.set_xlabel("decoder layer (index)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
    ax.set_ylabel("relative L2 error ‖a−b‖/‖b‖ (dimensionless)")
    if drawn:
        ax.set_yscale("log")
    else:
        _note(ax, "every tap is bitwise equal (rel_l2 = 0)")
    ax.legend(loc="best")


@_styled
def layer_growth(layers: pd.DataFrame, taps: tuple[str, ...], combos: tuple[str, ...] = (),
                 combo_tap: str = "resid_out", shipped: str = "none") -> Figure:
    """rel_l2 per tap against decoder layer (log y). With combos (an ablation): a second panel with one
    `combo_tap` line per combination. Only decoder layers (0..L-1) are drawn."""
    fig, axes = _new_figure(2 if combos else 1)
    base = layers[layers["combo"] == shipped] if combos else layers
    curves = [(tap, base[base["tap"] == tap]) for tap in taps]
    _layer_lines(axes[0], curves, "error growth by tap" + (f" (as shipped: {shipped})" if combos else ""))
    if combos:
        tap_rows = layers[layers["tap"] == combo_tap]
        _layer_lines(axes[1], [(c, tap_rows[tap_rows["combo"] == c]) for c in combos],
                     f"{combo_tap} by aligned regions")
    return fig


# ---------------------------------------------------------------------------------------------- (2) Δlogprob
@_styled
def delta_histogram(series: list[tuple[str, np.ndarray]], infer: str = "logprob_infer") -> Figure:
    """Histogram of delta_logprob = logprob_train − logprob_infer; several series share the bins. `infer`: how the
    inference side is named on the axis (a score run's is the rollout's recorded logprob)."""
    fig, (ax,) = _new_figure()
    values = [np.asarray(v, dtype=np.float64) for _, v in series]
    edges = np.histogram_bin_edges(np.concatenate(values), bins=80)
    counts = []
    for i, ((label, _), v) in enumerate(zip(series, values)):
        s = style(i)
        if i == 0:  # the reference series filled and hatched, the others as outlines in their own line style
            n, _, _ = ax.hist(v, bins=edges, histtype="stepfilled", linewidth=1.2, facecolor="#e6e6e6",
                              edgecolor=s["color"], hatch=HATCHES[0], label=f"{label}: n={len(v)}")
        else:
            n, _, _ = ax.hist(v, bins=edges, histtype="step", linewidth=1.6, color=s["color"],
                              linestyle=s["linestyle"], label=f"{label}: n={len(v)}")
        counts.append(n)
    ax.axvline(0.0, color="#555555", linewidth=0.8)
    ax.set_title("distribution of Δlogprob")
    ax.set_xlabel(f"Δlogprob = logprob_train − {infer} (nats)")
    _count_axis(ax, np.concatenate(counts))
    if all((v == 0).all() for v in values):
        _note(ax, "every Δlogprob is exactly 0")
    ax.legend(loc="upper right")
    return fig


# ---------------------------------------------------------------------------------------------- (3) |Δ| vs p
@_styled
def delta_vs_probability(series: list[tuple[str, np.ndarray, np.ndarray]], infer: str = "logprob_infer") -> Figure:
    """|Δlogprob| against the inference-side probability exp(logprob_infer), log-log, per series
    (label, logprob_infer, delta_logprob); the line is the median |Δ| in each probability bin. `infer`: as in
    delta_histogram."""
    fig, (ax,) = _new_figure()
    ax.set_title("|Δlogprob| against the token's inference probability")
    ax.set_xlabel(f"inference-side token probability exp({infer}) (log scale)")
    ax.set_ylabel("|Δlogprob| (nats, log scale)")
    if not any((np.asarray(delta) != 0).any() for _, _, delta in series):
        _note(ax, "every Δlogprob is exactly 0")  # nothing to draw on log axes
        return fig
    for i, (label, logp, delta) in enumerate(series):
        p, d = np.exp(np.asarray(logp, dtype=np.float64)), np.abs(np.asarray(delta, dtype=np.float64))
        keep = subsample(len(p))
        p_s, d_s = p[keep], _positive(d[keep])
        zeros = int((d == 0).sum())
        s = style(i)
        shown = f"{label}: n={len(p)}" if len(keep) == len(p) else f"{label}: {len(keep)} of {len(p)} shown (sampled)"
        shown += f", {zeros} with Δ=0 not shown" if zeros else ""
        ax.scatter(p_s, d_s, s=5, marker=s["marker"], facecolors="none" if s["marker"] not in "x+" else s["color"],
                   edgecolors=s["color"], linewidths=0.5, alpha=0.5, rasterized=True, label=shown)
        if (d > 0).any():
            lo = max(np.log10(p[p > 0].min()), -30.0)
            edges = np.linspace(lo, 0.0, 25)
            which = np.clip(np.digitize(np.log10(np.maximum(p, 1e-300)), edges) - 1, 0, len(edges) - 2)
            # a median of fewer than 5 tokens is noise: leave a gap
            med = np.array([np.median(d[which == b]) if (which == b).sum() >= 5 else np.nan
                            for b in range(len(edges) - 1)])
            centres = 10 ** ((edges[:-1] + edges[1:]) / 2)
            ax.plot(centres, _positive(med), color=s["color"], linestyle=s["linestyle"], linewidth=1.8,
                    label=f"{label}: median per bin")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(loc="lower left", markerscale=2.5)
    return fig


# ---------------------------------------------------------------------------------------------- (4) KL
@_styled
def kl_by_position(panels: list[tuple[str, str, list[tuple[str, pd.DataFrame]]]]) -> Figure:
    """Per-token KL(π_infer ‖ π_train) averaged over sequences at each position (log y). One panel per
    (title, x label, series); each series frame has `x` (the position), `kl` and `seq` (a sequence id)."""
    fig, axes = _new_figure(len(panels))
    for ax, (title, xlabel, series) in zip(axes, panels):
        drawn = 0
        # The per-position mean is noisy where few sequences reach; a centred rolling mean shows the trend.
        window = max(1, max((df["x"].nunique() for _, df in series), default=1) // 40)
        for i, (label, df) in enumerate(series):
            mean = df.groupby("x", sort=True)["kl"].mean()
            y = _positive(mean.to_numpy())
            drawn += int(not np.isnan(y).all())
            s = style(i)
            x = mean.index.to_numpy()
            if window > 1:
                ax.plot(x, y, color=s["color"], linestyle="-", linewidth=0.6, alpha=0.35)
                y = _positive(pd.Series(mean.to_numpy()).rolling(window, center=True, min_periods=1).mean())
            ax.plot(x, y, color=s["color"], linestyle=s["linestyle"], linewidth=1.8,
                    label=f"{label} ({df['seq'].nunique()} sequences)")
        ax.set_title(title + (f"\n(thick: rolling mean over {window} positions; thin: each position)"
                              if window > 1 else ""), fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean KL(π_infer ‖ π_train) (nats, log scale)")
        if drawn:
            ax.set_yscale("log")
        else:
            _note(ax, "every KL is exactly 0")
        ax.legend(loc="upper right")
    return fig


# ---------------------------------------------------------------------------------------------- (5) attribution
@_styled
def attribution_bars(attribution: pd.DataFrame, metric: str, level: str) -> Figure:
    """Each region's Shapley change of the metric as a percent of the shipped metric (negative: removes mismatch,
    positive: adds it) with its bootstrap interval (`level`, e.g. "95%"), and the change of aligning every region."""
    fig, (ax,) = _new_figure()
    labels = list(attribution["region"])
    values = 100 * attribution[SHARE].to_numpy(dtype=np.float64)
    low = 100 * attribution["share_ci_low"].to_numpy(dtype=np.float64)
    high = 100 * attribution["share_ci_high"].to_numpy(dtype=np.float64)
    x = np.arange(len(labels))
    is_all = np.array([r == ALL_REGIONS for r in labels])
    for i in range(len(labels)):
        ax.bar(x[i], values[i], width=0.6, color="#bbbbbb" if is_all[i] else "#ffffff",
               edgecolor="#000000", linewidth=1.0, hatch="..." if is_all[i] else HATCHES[i % 2])
    ok = np.isfinite(low) & np.isfinite(high)
    if ok.any():
        err = np.vstack([np.maximum(values - low, 0), np.maximum(high - values, 0)])[:, ok]
        ax.errorbar(x[ok], values[ok], yerr=err, fmt="none", ecolor="#000000", elinewidth=1.2, capsize=5)
    for i in range(len(labels)):
        if np.isfinite(values[i]):
            up = values[i] >= 0
            end = (high[i] if up else low[i]) if np.isfinite(low[i]) and np.isfinite(high[i]) else values[i]
            ax.annotate(change_words(values[i] / 100), (x[i], end), xytext=(0, 4 if up else -4),
                        textcoords="offset points", ha="center", va="bottom" if up else "top", fontsize=9)
    ax.axhline(0.0, color="#000000", linewidth=0.8)
    if is_all.any() and (~is_all).any():
        ax.axvline(x[is_all][0] - 0.5, color="#777777", linestyle="--", linewidth=0.8)
    ax.set_xticks(x, [("all regions\n(together)" if r else lab) for lab, r in zip(labels, is_all)])
    ax.set_title(f"change in {metric} when aligned, % of shipped"
                 + (f" (whiskers: {level} bootstrap interval)" if ok.any() else ""))
    ax.set_xlabel("region (aligned: FP32 until its output)")
    ax.set_ylabel(f"Shapley change in {metric}, % of shipped\n(below 0: removes mismatch; above: adds)")
    ax.margins(y=0.2)
    return fig


# ---------------------------------------------------------------------------------------------- (6) ratio
@_styled
def ratio_histogram(rho: np.ndarray, eps: float, infer: str = "logprob_infer") -> Figure:
    """Importance ratio ρ = exp(logprob_train − logprob_infer) on response tokens, with the clip band [1−ε, 1+ε].
    `infer`: as in delta_histogram."""
    fig, (ax,) = _new_figure()
    rho = np.asarray(rho, dtype=np.float64)
    lo, hi = 1.0 - eps, 1.0 + eps
    outside = int(((rho < lo) | (rho > hi)).sum())
    finite = rho[np.isfinite(rho)]
    ax.axvspan(lo, hi, facecolor="#f2f2f2", edgecolor="#b0b0b0", hatch="//", linewidth=0.0,
               label=f"clip band [1−ε, 1+ε], ε = {eps:g}")
    ax.axvline(lo, color="#555555", linestyle="--", linewidth=1.0)
    ax.axvline(hi, color="#555555", linestyle="--", linewidth=1.0)
    if len(finite):
        edges = np.histogram_bin_edges(finite, bins=100)
        counts, _, _ = ax.hist(finite, bins=edges, histtype="stepfilled", facecolor="#777777", edgecolor="#000000",
                               linewidth=0.8, label=f"response tokens (n={len(rho)}; {outside} outside the band)")
        _count_axis(ax, counts)
        span = (min(finite.min(), lo), max(finite.max(), hi))
        pad = 0.05 * (span[1] - span[0])
        ax.set_xlim(span[0] - pad, span[1] + pad)
    else:
        _note(ax, "no response tokens")
    ax.axvline(1.0, color="#000000", linewidth=0.8)
    ax.set_title("importance ratio on response tokens")
    ax.set_xlabel(f"importance ratio ρ = exp(logprob_train − {infer}) (dimensionless)")
    ax.legend(loc="upper right")
    return fig


# ---------------------------------------------------------------------------------------------- (7) routing
@_styled
def routing_flips(series: list[tuple[str, pd.DataFrame, str]], top_k: int | None = None) -> Figure:
    """Percentage of routed tokens run through a different top-k expert set, per MoE layer: one line per (label, frame
    with `layer`, the frame's flip rate column), the mismatch first, then each stack's own floor (linear: 0 is a flip
    rate)."""
    fig, (ax,) = _new_figure()
    flipped = 0
    for i, (label, df, column) in enumerate(series):
        y = 100 * df[column].to_numpy(dtype=np.float64)
        ax.plot(df["layer"].to_numpy(), y, label=label, linewidth=1.4, markersize=4.5,
                markevery=(i % 3, 3) if len(df) > 12 else None, markerfacecolor="none", **style(i))
        flipped += int((y > 0).any())
    ax.set_title(f"tokens routed to a different top-{top_k or 'k'} expert set, per MoE layer")
    ax.set_xlabel("decoder layer (index)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("tokens whose expert set differs (%)")
    ax.set_ylim(bottom=0)
    if not flipped:
        _note(ax, "no flips: every token has the same experts on both sides")
    ax.legend(loc="best")
    return fig


# ---------------------------------------------------------------------------------------------- (8) grafting
@_styled
def local_vs_propagated(local: pd.DataFrame, families: tuple[str, ...]) -> Figure:
    """Per op family and decoder layer: the local error (solid; the training op on the inference inputs) and the
    propagated error (dashed; today's per-tap diff), each the mean rel_l2 over the family's seams in that layer."""
    fig, [ax] = _new_figure()
    drawn = 0
    handles = []
    for i, family in enumerate(families):
        rows = local[local["family"] == family]
        if rows.empty:
            continue
        by_layer = rows.groupby("layer")[["local_rel_l2", "propagated_rel_l2"]].mean().sort_index()
        s = style(i)
        zero = True
        for column, linestyle, kind in (("local_rel_l2", "-", "local"), ("propagated_rel_l2", "--", "propagated")):
            y = _positive(by_layer[column])
            ax.plot(by_layer.index.to_numpy(), y, linewidth=1.4, markersize=4.5, color=s["color"],
                    linestyle=linestyle, marker=s["marker"], markerfacecolor="none" if kind == "local" else s["color"])
            drawn += int(not np.isnan(y).all())
            zero &= bool(np.isnan(y).all())
        # one legend entry per family (its colour and marker); the line style says local or propagated
        handles.append(Line2D([], [], color=s["color"], marker=s["marker"], linestyle="none",
                              label=family + (" (all 0)" if zero else "")))
    handles += [Line2D([], [], color="#000000", linestyle="-", label="local (solid)"),
                Line2D([], [], color="#000000", linestyle="--", label="propagated (dashed)")]
    ax.set_xlabel("layer (index; the last is the final norm and lm_head)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("relative L2 error ‖a−b‖/‖b‖ (dimensionless)")
    ax.set_title("local (solid) vs propagated (dashed) error by op family")
    if drawn:
        ax.set_yscale("log")
    else:
        _note(ax, "every seam is bitwise equal (rel_l2 = 0)")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # beside the data
    return fig


@_styled
def depth_curve(depth: pd.DataFrame, num_layers: int) -> Figure:
    """Mean |Δlogprob| and mean KL of the training forward continued from the inference stack's residual stream
    entering each layer (x = L: entering the final norm; x = L+1: the final norm's output, lm_head alone)."""
    fig, axes = _new_figure(2)
    x = depth["layer"].to_numpy()
    for ax, column, ylabel in ((axes[0], "mean_abs_dlogp", "mean |Δlogprob| (nats)"),
                               (axes[1], "mean_kl", "mean KL(π_infer ‖ π_train) (nats)")):
        y = depth[column].to_numpy(dtype=np.float64)
        ax.plot(x, y, linewidth=1.4, markersize=5, markerfacecolor="none", **style(0))
        ax.set_xlabel("graft point: training forward from layer (index)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.axvline(num_layers - 0.5, color="#999999", linewidth=0.8)  # decoder layers | final norm, lm_head
        ax.set_ylim(bottom=0)
    axes[0].set_title("gap made by the layers from x on")
    axes[1].set_title(f"x = {num_layers}: final norm + lm_head; {num_layers + 1}: lm_head")
    return fig


@_styled
def metrics_by_step(step: pd.Series, steps: pd.DataFrame, panels: list[tuple[str, float, int | None]],
                    reward: pd.Series | None = None) -> Figure:
    """A run's history (score over many steps): one panel per alarm (metric, threshold, first step past it), the
    metric against step on a log axis with its threshold dashed and its first crossing marked; the mean reward, when
    the files recorded one, on a second axis of the first panel (the collapse it foreshadows)."""
    fig, axes = _new_figure(max(len(panels), 1))
    x = step.to_numpy()
    for i, (ax, (metric, threshold, fired)) in enumerate(zip(axes, panels)):
        y = _positive(steps[metric])
        ax.plot(x, y, linewidth=1.2, markersize=3, markerfacecolor="none", label=metric, **style(0))
        ax.axhline(threshold, color=COLORS[2], linestyle="--", linewidth=1.0, label=f"alarm: > {threshold:g}")
        if fired is not None:
            ax.axvline(fired, color=COLORS[2], linestyle=":", linewidth=1.0, label=f"first past it: step {fired}")
        if np.isfinite(y).any():
            ax.set_yscale("log")
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(f"{metric} (per token)")
        ax.set_title(metric)
        if i == 0 and reward is not None:
            twin = ax.twinx()
            twin.plot(x, reward.to_numpy(dtype=np.float64), linewidth=1.0, markersize=3, label="mean reward",
                      **style(1))
            twin.set_ylabel("mean reward")
            twin.grid(False)
            twin.legend(loc="lower right")
        ax.legend(loc="upper left")
    if not panels:
        _note(axes[0], "no alarm metric was measured")
    return fig
