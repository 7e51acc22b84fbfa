"""compare's and ablate's results on stdout: the summary table (mismatch beside its noise floors, routing, the local
error per op family), the ablation's combinations and its attribution with intervals."""

from __future__ import annotations

from rich.table import Table

from .console import out, say


def print_summary(run) -> None:
    from ..numerics.noise_verdict import LEVEL, RATIO, in_words
    from ..numerics.reference import in_words as reference_words
    from ..numerics.shapley import MIN_PROMPTS
    from ..numerics.tables import FLOOR_KINDS, NOISE_FLOORS, NOT_CAPTURED, largest_noise_floor, worst_layer
    from ..spec.load import DEFAULT_INFER

    s = run.summary
    table = Table(title="vLLM vs transformers" if run.manifest["load"]["infer"] == DEFAULT_INFER else "infer vs train", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("response tokens scored" if "k3" in s else "tokens scored", str(s["n_tokens"]))
    table.add_row("mean |Δlogp|", f"{s['mean_abs_dlogp']:.3e}")
    table.add_row("max |Δlogp|", f"{s['max_abs_dlogp']:.3e}")
    table.add_row("p99 |Δlogp|", f"{s['p99_abs_dlogp']:.3e}")
    table.add_row("mean KL(infer‖train)", f"{s['mean_kl']:.3e}")
    table.add_row("max KL", f"{s['max_kl']:.3e}")
    if s["first_inexact"] != NOT_CAPTURED:  # --taps none: no tap rows to show
        table.add_row("first inexact tap", s["first_inexact"])
        table.add_row(f"first tap over rel_l2 {run.threshold:g}", s["first_over_threshold"])
    worst = worst_layer(run.tap_stats)
    if worst:
        table.add_row("worst layer (resid_out rel_l2)", f"{worst[0]} ({worst[1]:.3e})")
    # each floor labelled by its kind (tables.FLOOR_KINDS): "noise floor: ..." or "systematic floor: ..."
    for key, label in [("noise_infer_mean_abs_dlogp", "infer alone vs batched"),
                       ("noise_train_mean_abs_dlogp", "train alone vs batched"),
                       ("noise_train_kernel_mean_abs_dlogp", "train, another SDPA kernel"),
                       ("noise_infer_engine_mode_mean_abs_dlogp", "engine, other mode"),
                       ("noise_infer_tensor_parallel_mean_abs_dlogp", "engine, tensor_parallel_size 1"),
                       ("noise_train_tensor_parallel_mean_abs_dlogp", "train, unsharded (--train-tp 1)"),
                       ("tap_points_mean_abs_dlogp", "engine with vs without tap points"),
                       ("k3", "k3 KL estimate"), ("ratio_min", "min importance ratio"), ("ratio_max", "max importance ratio"),
                       ("ppo_clip_frac", "PPO-clipped fraction (numerics alone)"), ("ess", "effective sample size")]:
        if key in s:
            table.add_row(f"{FLOOR_KINDS[key]} floor: {label}" if key in FLOOR_KINDS else label, f"{s[key]:.3e}")
    if "dominant_factor" in s:  # generate mode: trainer/prefill, prefill/decode or decode/recorded
        table.add_row("largest factor of π_train/π_recorded", s["dominant_factor"])
    largest = largest_noise_floor(s)
    if largest is None:  # a mismatch means little without it; say how to get it
        table.add_row("noise floor", "not measured (--batch-invariance, --engine-noise)")
    else:
        if largest[1] > 0:
            low, high = s[RATIO + "_ci_low"], s[RATIO + "_ci_high"]
            interval = (f"{LEVEL:.0%} CI [{low:.3g}x, {high:.3g}x]" if low == low and high == high
                        else f"no interval (fewer than {MIN_PROMPTS} prompts)")
            table.add_row("mismatch / largest floor",
                          f"{s[RATIO]:.3g}x, {interval} ({NOISE_FLOORS[largest[0]]}: {FLOOR_KINDS[largest[0]]})")
        table.add_row("normal or not", in_words(s))
    routing_rows(table, s, "routing" in run.spec.align.regions)
    out.print(table)
    if reference_words(s):  # --reference: which side is further from exact, a paragraph under the table
        say(reference_words(s))
    print_graft(getattr(run, "graft_tables", {}), run.manifest.get("model", {}).get("num_layers"))


def routing_rows(table, s: dict, replayed: bool) -> None:
    """A mixture-of-experts run: how often the stacks run a token through other experts, beside every routing noise
    floor measured (each stack's batch change, the trainer's kernel change) and the ratio to the largest, and |Δlogp|
    of the tokens right after a flipped position against the others (routing.csv: per layer). With routes replayed
    the trainer ran the engine's experts, so the count is zero by construction and the routers' own disagreement is
    in routing.csv's logit columns: the row says so rather than read as agreement."""
    from ..numerics.tables import FLOOR_KINDS, ROUTING_NOISE_FLOORS, noise_floors

    if "frac_tokens_any_flip" not in s:
        return
    flips = s["frac_tokens_any_flip"]
    table.add_row("tokens run through other experts (any layer)",
                  "not recorded (manifest.json)" if flips != flips else f"{flips:.2%}")  # NaN: a side gave no ids
    if replayed:
        table.add_row("routers disagree", "routes replayed: both ran the engine's experts; where the routers' logits "
                                          "still differ is routing.csv's frac_topk_set_differs")
    for name, value in noise_floors(s, ROUTING_NOISE_FLOORS).items():
        table.add_row(f"routing noise floor: {ROUTING_NOISE_FLOORS[name]}", f"{value:.2%}")
    if "routing_largest_noise_floor" in s:
        table.add_row("routed differently / largest routing floor",
                      f"{s['frac_tokens_any_flip_over_largest_floor']:.3g}x "
                      f"({ROUTING_NOISE_FLOORS[s['routing_largest_noise_floor']]}: "
                      f"{FLOOR_KINDS[s['routing_largest_noise_floor']]})")  # by the floor's name: older folders too
    after, elsewhere = s["mean_abs_dlogp_after_flip"], s["mean_abs_dlogp_not_after_flip"]
    table.add_row("mean |Δlogp| after a flip / elsewhere",
                  "no flips" if after != after else f"{after:.3e} / {elsewhere:.3e}")  # NaN: no token after a flip


def print_graft(tables: dict, num_layers: int | None) -> None:
    """compare --graft / --depth: the local error per op family beside the propagated one (local_families.csv),
    largest local error first, and in words which family and which step of the forward add most."""
    from ..numerics.graft_reading import amplification_text, families_by_local, findings

    families = tables.get("local_families.csv")
    if families is not None:
        table = Table(title="local error per op family (local_families.csv), largest first")
        for column in ("family", "local rel_l2", "propagated rel_l2", "amplification"):
            table.add_column(column, justify="left" if column == "family" else "right")
        for row in families_by_local(families).to_dict("records"):
            table.add_row(row["family"], f"{row['local_rel_l2']:.3e}", f"{row['propagated_rel_l2']:.3e}",
                          amplification_text(row))
        out.print(table)
    for line in findings({name.removesuffix(".csv"): t for name, t in tables.items()}, num_layers):
        say(line)



def print_ablation(run) -> None:
    from ..numerics.noise_verdict import floor_moved
    from ..numerics.reference import combination_lines
    from ..numerics.shapley import CHANGE, SHARE, SHIPPED, attribution_lines, effect_words
    from ..numerics.tables import NOT_CAPTURED

    metric = run.spec.ablate.metric
    combos = run.ablation_table.sort_values(metric, kind="stable")
    table = Table(title=f"ablation ({run.spec.align.side}), sorted by {metric}")
    taps = (combos["first_inexact"] != NOT_CAPTURED).any()  # --taps none: no first-divergence column
    for col in ("combo", metric, "mean_abs_dlogp", *(["first_inexact"] if taps else [])):
        table.add_column(col, justify="left" if col in ("combo", "first_inexact") else "right")
    for row in combos.itertuples():
        table.add_row(row.combo, f"{getattr(row, metric):.3e}", f"{row.mean_abs_dlogp:.3e}",
                      *([row.first_inexact] if taps else []))
    out.print(table)
    shipped = run.metric_of()[frozenset()]
    attr = Table(title=f"change in {metric} when aligned, as a share of the shipped {shipped:.3e} "
                       "(− removes mismatch, + adds)")
    pct = f"{run.spec.ablate.ci_level:.0%}"
    level = f"{pct} CI"
    factors = bool(run.spec.ablate.factors)
    for col in ("region" + (" or factor" if factors else ""), "shapley change", "share of shipped", level,
                "main effect", "leave-one-out"):
        attr.add_column(col, justify="left" if col.startswith("region") else "right")
    def signed(x: float, spec: str = "+.3e") -> str:
        return "" if x != x else format(x, spec)

    rows = run.attribution_table.to_dict("records")
    for row in rows:
        low, high = row["share_ci_low"], row["share_ci_high"]
        attr.add_row(row["region"], signed(row[CHANGE]), effect_words(row[SHARE], low, high, pct),
                     f"[{signed(low, '+.1%')}, {signed(high, '+.1%')}]" if low == low and high == high else "none",
                     signed(row["main_effect_change"]), signed(row["leave_one_out_change"]))
    out.print(attr)
    summaries = run.ablation_table.set_index("combo")
    everything = summaries.index[-1]  # subsets() order: every region aligned comes last
    moved = floor_moved(summaries.loc[SHIPPED].to_dict(), summaries.loc[everything].to_dict(), everything)
    for line in attribution_lines(rows, metric, factors, pct) + ([moved] if moved else []):
        say(line)
    for line in combination_lines(run.ablation_table, run.tokens_table, SHIPPED, run.spec.load.seed):  # --reference
        say(line)

