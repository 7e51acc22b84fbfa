"""The report's Routing section, for a mixture-of-experts run (one whose folder has routing.csv).

For MoE the largest train-inference mismatch is often not rounding inside a layer but routing: a near-tied top-k
flips and the token goes through other experts. So the section puts the flip rate of each MoE layer beside each
stack's own flips under a batch change (a flip rate alone says little when a stack flips as often against itself),
sets the |Δlogprob| of tokens after a flip against the others, says whether the trainer replayed the engine's routes,
and, in an ablation with a `routing` region, how much of the mismatch routing explains. What every column means:
docs/reference/moe.md, "MoE routing".
"""

from __future__ import annotations

import pandas as pd

from ..numerics.shapley import CHANGE, SHARE, SHIPPED, change_words, effect_words
from .document import Column, Heading, Paragraph, Table
from .run_data import RunData, row_of, shipped_rows
from ..numerics.tables import FLOOR_KINDS, ROUTING_NOISE_FLOORS
from .wording import _code, _finite, _get, _num, read_intervals, share_interval, too_few_prompts

ROUTING = "routing"  # the ablation region that replays the engine's routes in the trainer
REPLAYS = {  # manifest compare.routing.replay / spec.align.routing_replay -> what the trainer ran
    "ids": "the engine's expert ids with its own gate weights (R3, `--routing-replay ids`)",
    "ids+weights": "the engine's expert ids and gate weights (`--routing-replay ids+weights`)",
}
SIDES = ("infer", "train")


def has_routing(run: RunData) -> bool:
    return ROUTING in run.extra


def _pct(x) -> str:
    return _num(100 * float(x)) + "%"


def _stack(run: RunData, side: str) -> str:
    return str(_get(run.manifest, "stacks", side, "name", default=side))


RAN = "frac_experts_differ"  # routing.csv: the experts each stack's router returned (ran) differ
LOGITS = "frac_topk_set_differs"  # the router logits' top-k sets differ under every tie-break


def flip_column(rows: pd.DataFrame) -> str:
    """The column a flip rate is read from: the experts each stack ran where recorded, else (a run that recorded no
    expert ids, or one from before they were compared; local_routing.csv) the router logits' top-k sets, named so."""
    return RAN if RAN in rows and rows[RAN].notna().any() else LOGITS


def floor_labels(shipped) -> dict[str, str]:
    """Every routing noise floor the run measured (tables.ROUTING_NOISE_FLOORS: summary column -> the change)."""
    return {name: label for name, label in ROUTING_NOISE_FLOORS.items() if _finite(shipped.get(name))}


def flips_by_layer(run: RunData) -> pd.DataFrame:
    """routing.csv as shipped (an ablation's `none` block), one row per MoE layer in layer order."""
    return shipped_rows(run.extra[ROUTING]).sort_values("layer", kind="stable")


def all_aligned_flips(run: RunData) -> pd.DataFrame | None:
    """An ablation's routing.csv block with every region aligned: the router logits still disagree where replay
    hides it from the experts, and the numeric regions change how often."""
    routing = run.extra[ROUTING]
    if not run.all_aligned or run.all_aligned == SHIPPED or "combo" not in routing:
        return None
    rows = routing[routing["combo"] == run.all_aligned]
    return rows.sort_values("layer", kind="stable") if len(rows) else None


def local_flips(run: RunData) -> pd.DataFrame | None:
    """local_routing.csv as shipped (--graft): the trainer's router on the engine's own router input, per layer."""
    local = run.extra.get("local_routing")
    return None if local is None else shipped_rows(local).sort_values("layer", kind="stable")


def noise_floors(run: RunData) -> list[tuple[str, str, pd.DataFrame]]:
    """(label, what was changed, rows per layer) of each stack against itself in routing_noise.csv."""
    noise = run.extra.get("routing_noise")
    if noise is None:
        return []
    noise = shipped_rows(noise)
    noise = noise.assign(**{c: "" for c in ("stack", "change") if c not in noise})
    groups = list(noise.groupby(["side", "stack", "change"], sort=False))
    floors = []
    for (side, stack, change), rows in groups:
        several = sum(s == side for (s, _, _), _ in groups) > 1
        label = f"floor: {side} ({stack or _stack(run, side)}" + (f", {change})" if several else ")")
        floors.append((label, change, rows.sort_values("layer", kind="stable")))
    return floors


def _table(run: RunData) -> Table:
    flips = flips_by_layer(run)
    floors = noise_floors(run)
    aligned = all_aligned_flips(run)
    local = local_flips(run)
    metric = flip_column(flips)
    explained = [c for c in ("frac_differ_tie_collision", "frac_kth_tie_infer", "frac_kth_tie_train")
                 if metric == RAN and c in flips]
    columns = [Column("layer", "int"), Column(metric, "num"), *(Column(c, "num") for c in explained)]
    if metric == RAN:
        columns.append(Column(LOGITS, "num"))
    columns.append(Column("frac_flipped_near_tie", "num"))
    by_layer = [dict(zip(rows["layer"], rows[flip_column(rows)])) for _, _, rows in floors]
    columns += [Column(label, "num") for label, _, _ in floors]
    if local is not None:
        by_layer.append(dict(zip(local["layer"], local[LOGITS])))
        columns.append(Column(f"local: {LOGITS}", "num"))
    if aligned is not None:
        by_layer.append(dict(zip(aligned["layer"], aligned[flip_column(aligned)])))
        columns.append(Column(f"{run.all_aligned}: {flip_column(aligned)}", "num"))
    rows = tuple((int(r["layer"]), r[metric], *(r[c] for c in explained), *([r[LOGITS]] if metric == RAN else []),
                  None if pd.isna(r["frac_flipped_near_tie"]) else r["frac_flipped_near_tie"],
                  *(values.get(r["layer"]) for values in by_layer))
                 for r in flips.to_dict("records"))
    k = _get(run.manifest, "compare", "routing", "top_k", default="k")
    ulps = _get(run.manifest, "compare", "routing", "near_tie_ulps", default=1)
    source = f"routing.csv, combination `{SHIPPED}`" if run.is_ablate else "routing.csv"
    if metric == RAN:
        caption = (f"Routing flips per MoE layer ({source}): `{RAN}`, the fraction of routed tokens the two stacks "
                   f"ran through different top-{k} expert sets (the ids each router returned); "
                   "`frac_differ_tie_collision`, those whose logits' order agrees but an exact tie at the k-th place "
                   "was broken otherwise than the other side's order; `frac_kth_tie_*`, how often each side's k-th "
                   f"place is an exact tie; `{LOGITS}`, the tokens whose router logits' top-{k} sets differ under "
                   "every tie-break (strict order differences); ")
    else:
        caption = (f"Routing flips per MoE layer ({source}; this run recorded no expert ids, so the router logits "
                   f"alone): `{LOGITS}`, the fraction of routed tokens whose top-{k} expert set of the router logits "
                   "differs between the stacks under every tie-break; ")
    caption += (f"`frac_flipped_near_tie`, the fraction of the `{LOGITS}` tokens whose trainer-side margin between "
                f"the k-th and (k+1)-th router logit is at most {ulps:g} BF16 ULP (a dash: none).")
    if floors:
        caption += (f" Floor columns: `{metric}` of one stack against itself ("
                    + "; ".join(f"{label.removeprefix('floor: ')}: {change}" for label, change, _ in floors)
                    + "; routing_noise.csv).")
    if local is not None:
        caption += (" Local column: the trainer's router on the engine's own router input against the engine's "
                    "routes (local_routing.csv, --graft): the flips the routers make on identical input.")
    if aligned is not None:
        caption += (f" Last column: with every region aligned (`{run.all_aligned}`); the router logits are still "
                    "compared where the trainer replays the engine's routes.")
    return Table("routing", caption, tuple(columns), rows)


def _replay(run: RunData) -> str:
    replay = _get(run.manifest, "compare", "routing", "replay")
    if run.is_ablate and ROUTING in run.regions:
        variant = _get(run.manifest, "spec", "align", "routing_replay")
        text = ("Routes are replayed in every combination that aligns `routing`: there the trainer runs "
                + (REPLAYS.get(variant) or f"the engine's routes (variant {_code(variant)})") + " for every token "
                "and layer; the combinations without it let each stack route itself. Replay leaves the router "
                "logits alone, so routing.csv's logit columns still show where the two routers disagree.")
    elif replay:
        text = ("Routes were replayed (`--align routing`): the trainer ran "
                + (REPLAYS.get(replay) or f"the engine's routes (variant {_code(replay)})") + " for every token and "
                "layer, so the experts the two stacks ran agree (the trainer's router returned the engine's ids). "
                "Replay leaves the router logits alone, so routing.csv's logit columns still show where the two "
                "routers disagree: the replay overrode those.")
    else:
        text = ("Routes were not replayed: each stack ran the experts its own router chose, so every flip below is "
                "a token that went through different experts in the two stacks.")
    checked = _get(run.manifest, "compare", "routing", "engine_routes_checked_token_layers")
    if isinstance(checked, int) and checked > 0:
        text += (f" The routes the engine returned (the ids that vLLM's `enable_return_routed_experts` records for "
                 f"RL frameworks to replay) were checked to be a top-k of its own router logits for all {checked} "
                 "token-layer pairs.")
    return text


def _flips(run: RunData) -> str:
    flips = flips_by_layer(run)
    shipped = row_of(run.summary, SHIPPED)
    metric = flip_column(flips)
    frac = flips[metric].astype(float)
    worst = flips.loc[frac.idxmax()]
    scope = f"As shipped (`{SHIPPED}`), the" if run.is_ablate else "The"
    what = "ran" if metric == RAN else "picked from their router logits (this run recorded no expert ids)"
    # with routes replayed the trainer ran the engine's experts: the count is zero by construction, and the routers'
    # own disagreement is only in the logit columns
    replayed = not run.is_ablate and bool(_get(run.manifest, "compare", "routing", "replay"))
    if replayed and metric == RAN:
        return (f"{scope} routes were replayed: the trainer ran the engine's experts for every routed token. Its own "
                f"router still picks another top-k set than the engine's on {_pct(flips[LOGITS].astype(float).min())} "
                f"to {_pct(flips[LOGITS].astype(float).max())} of the routed tokens of a layer (`{LOGITS}`): the "
                "routers disagree, but no token went through other experts.")
    if not (frac > 0).any():
        return (f"{scope} two stacks ran every routed token through the same experts in all {len(flips)} MoE layers"
                + ("." if metric == RAN else " (by their router logits' top-k sets: this run recorded no expert "
                                             "ids)."))
    spread = (f"{_pct(frac.min())} to {_pct(frac.max())} of the routed tokens of a layer (mean {_pct(frac.mean())} "
              f"over {len(flips)} MoE layers, largest at layer {int(worst['layer'])}; `{metric}`")
    if replayed:  # an older run without ids: its logit count is the routers' disagreement, not experts that ran
        text = (f"{scope} two stacks' routers pick different expert sets for {spread}; the routes were replayed, so "
                "those tokens still went through the engine's experts in both stacks)")
    else:
        text = (f"{scope} two stacks ran {spread.replace(' (mean', ' through different expert sets (mean', 1)}"
                + ("" if metric == RAN else f", the experts {what}") + ")")
    tokens = flips["tokens"].astype(float)
    if metric == RAN and "frac_differ_tie_collision" in flips:
        collided = (flips["frac_differ_tie_collision"].astype(float) * tokens).sum() / (frac * tokens).sum()
        ties = [f"{_pct(flips[f'frac_kth_tie_{side}'].astype(float).mean())} ({_stack(run, side)})" for side in SIDES]
        text += (f". Of those, {_pct(collided)} are tie collisions: the k-th place was an exact tie on one side "
                 "(on " + " and ".join(ties) + " of the token-layers on average), broken otherwise than the other "
                 "side's order; the rest are strict order differences of the router logits")
    n_strict = tokens * flips[LOGITS].astype(float)
    near = flips["frac_flipped_near_tie"].astype(float)
    if near.notna().any() and n_strict[near.notna()].sum() > 0:
        ulps = _get(run.manifest, "compare", "routing", "near_tie_ulps", default=1)
        pooled = (near * n_strict)[near.notna()].sum() / n_strict[near.notna()].sum()
        text += (f"; {_pct(pooled)} of the strict order differences had a trainer-side margin between the k-th and "
                 f"(k+1)-th router logit of at most {ulps:g} BF16 ULP, so a last-bit rounding alone explains them")
    text += "."
    if not _finite(shipped.get("frac_tokens_any_flip")):
        return text
    any_flip = float(shipped["frac_tokens_any_flip"])
    text += (f" The routers disagree on **{_pct(any_flip)}** of the routed positions in at least one layer "
             "(`frac_tokens_any_flip`; routes replayed, so no token was routed differently)" if replayed else
             f" **{_pct(any_flip)}** of the routed positions ran through other experts in at least one layer "
             "(`frac_tokens_any_flip`)")
    floors = floor_labels(shipped)
    if not floors:
        return text + (". No routing noise floor was measured: a compare with `--batch-invariance` shows how often "
                       "each stack flips against itself under a batch or kernel change (routing_noise.csv).")
    text += "; against itself, " + "; ".join(
        f"{_pct(float(shipped[name]))} under {label}" for name, label in floors.items()) + "."
    name, largest = max(((n, float(shipped[n])) for n in floors), key=lambda item: item[1])
    if largest > 0:
        text += (f" The mismatch flips {_num(any_flip / largest)}× as many positions as the largest floor ("
                 f"{floors[name]}, a {FLOOR_KINDS[name]} floor)" + (": no more than a stack's own change does." if any_flip <= largest else "."))
    return text


def _dlogp(run: RunData) -> str | None:
    s = row_of(run.summary, SHIPPED)
    if not _finite(s.get("mean_abs_dlogp_after_flip")):
        return None
    def against(flipped: float, other) -> str:
        if not _finite(other):
            return "; there are no others"
        return f", against {_num(other)} for the others" + (
            f" ({_num(flipped / float(other))}×)" if float(other) > 0 else "")

    after = float(s["mean_abs_dlogp_after_flip"])
    text = (f"Scored tokens whose logits came from a flipped position ({_pct(s['frac_tokens_after_flip'])} of "
            f"them) differ by a mean |Δlogprob| of **{_num(after)}** nats"
            + against(after, s.get("mean_abs_dlogp_not_after_flip")) + ".")
    if _finite(s.get("mean_abs_dlogp_upstream_flip")):
        upstream = float(s["mean_abs_dlogp_upstream_flip"])
        text += (f" Those with a flip anywhere earlier in their sequence, in the causal cone of the logits "
                 f"({_pct(s['frac_tokens_upstream_flip'])} of the tokens), differ by {_num(upstream)} nats"
                 + against(upstream, s.get("mean_abs_dlogp_no_upstream_flip")) + ".")
    return text


def _attribution(run: RunData) -> str | None:
    a = run.attribution
    if a is None or ROUTING not in run.regions or not (a["region"] == ROUTING).any():
        return None
    a, few = read_intervals(run, a)
    r = a[a["region"] == ROUTING].iloc[0]
    m = run.metric
    shipped = float(row_of(run.summary, SHIPPED)[m])
    low, high = float(r["share_ci_low"]), float(r["share_ci_high"])
    text = (too_few_prompts(run) if few else "") + (
        f"In the ablation, replaying the routes (region `routing`) **{effect_words(float(r[SHARE]), low, high, run.ci_level)}**"
        f"{share_interval(low, high, run.ci_level)} of the shipped `{m}` ({_num(shipped)}; Shapley change "
        f"{_num(r[CHANGE])})")
    others = [x for x in run.regions if x != ROUTING]
    if others:
        rest = a[a["region"].isin(others)][SHARE].astype(float).sum()
        text += f"; the other regions ({', '.join(_code(x) for x in others)}) together {change_words(rest)}"
    if _finite(r.get("main_effect_change")) and shipped:
        text += (f". Replaying the routes alone {change_words(float(r['main_effect_change']) / shipped)} of "
                 "the shipped value")
    return text + "."


def routing_section(run: RunData) -> list:
    """The Routing heading, its prose and the per-layer table; nothing for a run without routing.csv."""
    if not has_routing(run):
        return []
    top_k = _get(run.manifest, "compare", "routing", "top_k", default="k")
    blocks: list = [Heading("Routing"), Paragraph(
        f"Every MoE layer's router sends each token to its top-{top_k} experts. A flip is a token the two stacks "
        "ran through different expert sets in a layer: the expert ids each stack's router returned. The "
        "`router_logits` taps explain each flip: a strict order difference of the logits, or a tie collision (an "
        "exact tie at the k-th place on one side, broken otherwise than the other side's order)."),
        Paragraph(_replay(run)), Paragraph(_flips(run))]
    blocks += [Paragraph(text) for text in (_dlogp(run), _attribution(run)) if text]
    return blocks + [_table(run)]
