"""Which figures a run gets, with their captions, and why any is left out; figures.py draws them."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ..numerics.shapley import SHIPPED
from .run_data import RunData, layers_of, response_rho, shipped_rows

KEY_TAPS = ("q_rope", "attn_core", "post_norm", "swiglu", "resid_out")
# A score run's inference side is the logprob its RL run's engine recorded (load.py reads tokens.csv's
# logprob_rollout as logprob_infer so every figure draws it): its axes name it as the user knows it.
INFER_LABEL_SCORE = "rollout (engine) logprob"


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
    panels = [("prompt tokens", "token position in the prompt (index)", [("prompt", frame(prompt, prompt["position"]))]),
              ("response tokens", "token position in the response (index)",
               [("response", frame(response, response["position"] - start))])]
    return panels if len(prompt) else panels[1:]  # a score run scores response tokens only


@dataclass(frozen=True)
class FigureSpec:
    stem: str
    title: str
    caption: str
    draw: object  # () -> matplotlib Figure


def figure_specs(run: RunData) -> tuple[list[FigureSpec], list[str]]:
    """The figures that apply to this run, and sentences about those that were skipped."""
    from . import figures as F
    from ..taps import LAYER_TAPS

    specs: list[FigureSpec] = []
    skipped: list[str] = []
    n_layers = run.num_layers
    layers = run.layers
    if n_layers is not None and len(layers):
        layers = layers[(layers["layer"] >= 0) & (layers["layer"] < n_layers) & layers["tap"].isin(LAYER_TAPS)]
    base = layers_of(run, SHIPPED if run.is_ablate else None)
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
    specs += _routing_specs(run)

    infer = INFER_LABEL_SCORE if run.is_score else "logprob_infer"
    if run.tokens is None:
        skipped.append("This run folder has no tokens.csv (nor tokens.csv.gz), so the token-level figures "
                       "(Δlogprob histogram, |Δlogprob| against probability, KL along the position) are not drawn.")
    else:
        series = _token_series(run)
        specs.append(FigureSpec(
            "delta_hist", "Distribution of Δlogprob",
            f"Δlogprob = logprob_train − {infer} of every scored token, in nats. A narrow peak "
            "symmetric about 0 means the stacks differ by rounding noise; a shifted peak means one stack "
            "systematically gives the scored tokens more probability.",
            lambda: F.delta_histogram([(label, df["delta_logprob"].to_numpy()) for label, df in series], infer)))
        specs.append(FigureSpec(
            "delta_vs_prob", "|Δlogprob| against token probability",
            "Each point is one scored token (at most 20000 per series, sampled with a fixed seed): its probability "
            "under the inference stack against |Δlogprob|, log-log. Lines: the median |Δlogprob| per probability "
            "bin. Tokens with exactly equal logprobs cannot be drawn on a log axis; the legend counts them.",
            lambda: F.delta_vs_probability([(label, df["logprob_infer"].to_numpy(), df["delta_logprob"].to_numpy())
                                            for label, df in series], infer)))
        if run.tokens["kl"].isna().all():  # a score run without --infer vllm: no engine distribution to compare
            skipped.append("No token has a KL (tokens.csv's `kl` is empty: a score run measures it only with "
                           "`--infer vllm`), so the KL-by-position figure is not drawn.")
        else:
            if run.is_score:  # response tokens only; the KL is the engine's prefill against the trainer
                panels = (" Here π_infer is the engine's prefill of the recorded sequences; response tokens by "
                          "position in the response (0 = first sampled token).")
            elif "is_response" in run.tokens:
                panels = (" Left: prompt tokens by position in the prompt; right: response tokens by position in the "
                          "response (0 = first sampled token).")
            else:
                panels = ""
            specs.append(FigureSpec(
                "kl_by_position", "Per-token KL along the position",
                "Exact KL(π_infer ‖ π_train) over the full vocabulary at each token position, averaged over the "
                "sequences that reach that position (log scale). Fewer sequences reach late positions, so the tail "
                "is noisier; a rising trend means the mismatch accumulates with context length." + panels,
                lambda: F.kl_by_position(_kl_panels(run, series))))
    if run.attribution is not None:
        specs.append(FigureSpec(
            "attribution", "Attribution to regions",
            f"Bars: each region's Shapley change of `{run.metric}` when aligned (its average over every order of "
            "aligning the regions), as a percent of the shipped value: below 0 the region removes mismatch, above 0 "
            f"it adds some; whiskers: {run.ci_level} bootstrap interval over prompts. The dotted grey bar is the "
            "change of aligning every region together, the regions' bars added up.",
            lambda: F.attribution_bars(run.attribution, run.metric, run.ci_level)))
    specs += _graft_specs(run)
    rho = response_rho(run)
    if rho is not None:
        eps = run.clip_eps
        specs.append(FigureSpec(
            "ratio_hist", "Importance ratio on response tokens",
            f"Histogram of ρ = exp(Δlogprob) over response tokens, with the clip band "
            f"[1 − ε, 1 + ε], ε = {eps:g}, hatched. Any token outside the band is clipped by a PPO-style "
            "objective only because the two stacks round differently: the policy is the same.",
            lambda: F.ratio_histogram(rho, eps, infer)))
    elif run.is_generate:
        skipped.append("No response tokens (tokens with is_response) are available, so the importance-ratio "
                       "figure is not drawn.")
    return specs, skipped


def _graft_specs(run: RunData) -> list[FigureSpec]:
    """compare --graft / --depth: local vs propagated error by family and layer, and the depth curve."""
    from . import figures as F
    from ..numerics.graft_reading import FAMILIES

    specs = []
    if "local" in run.extra:
        local = shipped_rows(run.extra["local"])
        specs.append(FigureSpec(
            "local_vs_propagated", "Local vs propagated error by op family",
            "Solid: the local error of each op family per layer, the training stack's op run on the inference "
            "stack's own input of that op, against the inference output (identical inputs: the op's own rounding). "
            "Dashed: the propagated error, the same tap's diff in an ordinary compare, which also carries everything "
            "upstream. Each point is the mean relative L2 error over the family's seams in that layer (log scale; "
            "a gap: bitwise equal). A family whose solid line sits near its dashed line originates the mismatch; "
            "one whose solid line is absent only passes it on.",
            lambda: F.local_vs_propagated(local, FAMILIES)))
    if "depth" in run.extra and run.num_layers is not None:
        depth = shipped_rows(run.extra["depth"])
        specs.append(FigureSpec(
            "depth", "Depth attribution",
            "The training forward continued from the inference stack's residual stream entering layer x (x = 0: "
            "the embedding, the ordinary comparison; x = L: entering the final norm; x = L+1: from the inference "
            "final-norm output, the lm_head alone), scored against the inference logits. A point is the gap the "
            "layers from x on make when everything before x is the inference stack's: the drop between two "
            "points is what the layers between them add.",
            lambda: F.depth_curve(depth, run.num_layers)))
    return specs


def _routing_specs(run: RunData) -> list[FigureSpec]:
    """A MoE run: the flip rate per layer (routing.csv) beside each stack's own (routing_noise.csv)."""
    from . import figures as F
    from .moe import all_aligned_flips, flip_column, flips_by_layer, has_routing, local_flips, noise_floors

    if not has_routing(run):
        return []
    series = [("the two stacks" + (f" as shipped ({SHIPPED})" if run.is_ablate else ""), flips_by_layer(run))]
    aligned = all_aligned_flips(run)
    if aligned is not None:
        series.append((f"the two stacks, all aligned ({run.all_aligned})", aligned))
    series += [(label, rows) for label, _, rows in noise_floors(run)]
    local = local_flips(run)
    if local is not None:
        series.append(("the two routers on identical input (local_routing.csv)", local))
    top_k = run.manifest.get("compare", {}).get("routing", {}).get("top_k")
    return [FigureSpec(
        "routing", "Routing flips per MoE layer",
        "Percentage of routed tokens the two stacks ran through different top-k expert sets at each MoE layer "
        "(routing.csv: the ids each router returned, frac_experts_differ; the router logits' top-k sets where a run "
        "recorded no ids); the floor lines are each stack against itself under a batch change, and the trainer "
        "under another attention kernel (routing_noise.csv), where measured; with --graft, the local line is the trainer's router on the engine's "
        "own router input (local_routing.csv). A mismatch line well above both floors means the stacks' different "
        "rounding changes routes beyond what a batch change alone does.",
        lambda: F.routing_flips([(label, rows, flip_column(rows)) for label, rows in series], top_k))]
