"""routing: the metrics against a brute-force recomputation written plainly here (every tie-break of every
token enumerated with itertools, sets and loops), on hypothesis-drawn logits full of exact and near ties; and
one hand-worked case per metric."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from divergence_probe.numerics import routing

# -----------------------------------------------------------------------------
# the independent reference: enumerate every order each side's logits admit


def admissible_orders(row: list[float]) -> list[tuple[int, ...]]:
    """Every ranking of the experts that sorts `row` from high to low (ties in any order)."""
    return [p for p in itertools.permutations(range(len(row)))
            if all(row[p[i]] >= row[p[i + 1]] for i in range(len(p) - 1))]


def reference_token(a: list[float], b: list[float], k: int) -> dict:
    lists_a = {p[:k] for p in admissible_orders(a)}
    lists_b = {p[:k] for p in admissible_orders(b)}
    sets_a = {frozenset(x) for x in lists_a}
    sets_b = {frozenset(x) for x in lists_b}
    values = sorted(b, reverse=True)
    margin = values[k - 1] - values[k] if k < len(b) else math.inf
    big = max(abs(values[k - 1]), abs(values[k])) if k < len(b) else 0.0
    ulp = max(2.0 ** (math.frexp(big)[1] - 1 - 7), 2.0**-133)  # below 2^-126 BF16 is subnormal: steps of 2^-133
    return {
        "set_differs": not (sets_a & sets_b),
        "order_differs": not (lists_a & lists_b),
        "jaccard": max(len(x & y) / len(x | y) for x in sets_a for y in sets_b),
        "margin": margin,
        "near_tie": margin <= ulp,
    }


# Logits on a coarse grid of BF16-exact values (multiples of 1/8 in [-1, 1]) make exact ties common, and
# neighbouring BF16 values (x and x + 1 ULP) make near ties.
BF16_ROW = st.lists(st.integers(-8, 8).map(lambda n: n / 8), min_size=2, max_size=6)


def near(v: float) -> float:
    """v's BF16 neighbour one ULP further from zero (the next bit pattern)."""
    return (torch.tensor([v], dtype=torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).item()


@st.composite
def logit_pairs(draw):
    a = draw(BF16_ROW)
    n = len(a)
    # the trainer side: the engine's logits nudged by 0 or 1 BF16 ULP per expert, or drawn afresh
    if draw(st.booleans()):
        b = [near(x) if draw(st.booleans()) else x for x in a]
    else:
        b = draw(st.lists(st.integers(-8, 8).map(lambda v: v / 8), min_size=n, max_size=n))
    tokens = draw(st.integers(1, 3))
    rows_a, rows_b = [a], [b]
    for _ in range(tokens - 1):  # further tokens: permuted copies, so tokens differ
        perm = draw(st.permutations(range(n)))
        rows_a.append([a[i] for i in perm])
        rows_b.append([b[i] for i in perm])
    k = draw(st.integers(1, n))
    return rows_a, rows_b, k


@settings(max_examples=300, deadline=None)
@given(logit_pairs(), st.sampled_from([torch.bfloat16, torch.float32, torch.float64]))
def test_compare_layer_matches_brute_force(pair, dtype):
    rows_a, rows_b, k = pair
    got = routing.compare_layer(torch.tensor(rows_a, dtype=dtype), torch.tensor(rows_b, dtype=dtype), k)
    for t, (a, b) in enumerate(zip(rows_a, rows_b)):
        want = reference_token(a, b, k)
        assert bool(got.set_differs[t]) == want["set_differs"]
        assert bool(got.order_differs[t]) == want["order_differs"]
        assert got.jaccard[t].item() == pytest.approx(want["jaccard"])
        assert got.margin[t].item() == want["margin"]
        if k < len(a):
            assert bool(got.near_tie[t]) == want["near_tie"]


@settings(max_examples=200, deadline=None)
@given(logit_pairs())
def test_admissible_and_canonical_topk_match_brute_force(pair):
    rows_a, _, k = pair
    logits = torch.tensor(rows_a, dtype=torch.bfloat16)
    canonical = routing.topk_ids(logits, k)
    for t, a in enumerate(rows_a):
        orders = admissible_orders(a)
        admissible = {frozenset(p[:k]) for p in orders}
        assert tuple(canonical[t].tolist()) == min(p[:k] for p in orders)  # value, then ascending id
        for ids in itertools.combinations(range(len(a)), k):
            ok = routing.is_admissible_topk(logits[t:t + 1], torch.tensor([ids[::-1]]))  # order is irrelevant
            assert bool(ok[0]) == (frozenset(ids) in admissible)


# -----------------------------------------------------------------------------
# hand-worked cases, one per metric


def test_set_flip_and_jaccard_by_hand():
    train = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    infer = torch.tensor([[4.0, 1.0, 2.0, 3.0]])  # top-2: {0, 3} against the trainer's {0, 1}
    r = routing.compare_layer(infer, train, top_k=2)
    assert r.set_differs.tolist() == [True] and r.order_differs.tolist() == [True]
    assert r.jaccard.item() == pytest.approx(1 / 3)  # {0} of {0, 1, 3}
    assert r.margin.item() == 1.0  # the trainer's 2nd (3.0) minus its 3rd (2.0)


def test_order_flip_without_set_flip_by_hand():
    r = routing.compare_layer(torch.tensor([[3.0, 4.0, 1.0]]), torch.tensor([[4.0, 3.0, 1.0]]), top_k=2)
    assert r.set_differs.tolist() == [False] and r.order_differs.tolist() == [True]
    assert r.jaccard.item() == 1.0


def test_a_tie_break_is_not_a_flip():
    # the trainer ties experts 1 and 2 for the 2nd place; the engine's clear pick of 2 is one of its admissible
    # choices, so no flip; whichever of the two torch.topk would return
    train = torch.tensor([[5.0, 2.0, 2.0, 0.0]], dtype=torch.bfloat16)
    infer = torch.tensor([[5.0, 1.0, 2.0, 0.0]], dtype=torch.bfloat16)
    r = routing.compare_layer(infer, train, top_k=2)
    assert not r.set_differs.item() and not r.order_differs.item() and r.jaccard.item() == 1.0
    assert r.margin.item() == 0.0 and r.near_tie.item()
    assert routing.topk_ids(train, 2).tolist() == [[0, 1]]  # the canonical pick: the lower id
    assert routing.is_admissible_topk(train, torch.tensor([[2, 0]])).tolist() == [True]
    assert routing.is_admissible_topk(train, torch.tensor([[3, 0]])).tolist() == [False]
    assert routing.is_admissible_topk(train, torch.tensor([[0, 0]])).tolist() == [False]  # a repeated id


def test_near_tie_is_one_bf16_ulp():
    ulp = 2.0**-7  # BF16 spacing in [1, 2)
    train = torch.tensor([[1.5, 1.5 - ulp, 0.0], [1.5, 1.5 - 2 * ulp, 0.0]])
    infer = torch.tensor([[1.5 - ulp, 1.5, 0.0], [1.5 - 2 * ulp, 1.5, 0.0]])
    r = routing.compare_layer(infer, train, top_k=1)
    assert r.set_differs.tolist() == [True, True]
    assert r.near_tie.tolist() == [True, False]
    row = routing.layer_metrics(r)
    assert row["frac_flipped_near_tie"] == 0.5
    assert routing.bf16_ulp(torch.tensor([1.0, 1.99, 2.0, -3.0])).tolist() == [ulp, ulp, 2 * ulp, 2 * ulp]


def test_layer_metrics_by_hand():
    train = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0], [3.0, 2.5, 0.0], [1.0, 0.0, -1.0]])
    infer = torch.tensor([[2.0, 3.0, 0.0], [3.0, 2.0, 0.0], [3.0, 2.5, 0.0], [0.0, 1.0, -1.0]])
    row = routing.layer_metrics(routing.compare_layer(infer, train, top_k=1))
    assert row["frac_topk_set_differs"] == 0.5 and row["frac_topk_order_differs"] == 0.5
    assert row["mean_jaccard"] == 0.5
    assert row["frac_flipped_near_tie"] == 0.0
    assert row["margin_flipped_q50"] == 1.0  # tokens 0 and 3: margins 1 and 1
    assert row["margin_unflipped_q10"] == pytest.approx(0.55) and row["margin_unflipped_q90"] == pytest.approx(0.95)


def test_layer_metrics_without_flips_has_nan_near_tie_share():
    x = torch.tensor([[1.0, 0.0]])
    row = routing.layer_metrics(routing.compare_layer(x, x, top_k=1))
    assert row["frac_topk_set_differs"] == 0.0 and math.isnan(row["frac_flipped_near_tie"])
    assert math.isnan(row["margin_flipped_q50"]) and row["margin_unflipped_q50"] == 1.0


def test_all_experts_chosen_never_flips():
    r = routing.compare_layer(torch.tensor([[1.0, 2.0]]), torch.tensor([[2.0, 1.0]]), top_k=2)
    assert not r.set_differs.item() and r.order_differs.item() and r.margin.item() == math.inf


def test_token_flips_by_hand():
    def layer(flags):
        none = torch.zeros(len(flags), dtype=torch.bool)
        return routing.LayerRouting(set_differs=none, order_differs=none, jaccard=torch.ones(len(flags)),
                                    margin=torch.ones(len(flags)), near_tie=none, kth_tie_infer=none,
                                    kth_tie_train=none, experts_differ=torch.tensor(flags))

    flips, first = routing.token_flips([layer([False, True, False]), layer([False, True, True])])
    assert flips.tolist() == [0, 2, 1] and first.tolist() == [-1, 0, 1]
    assert routing.frac_tokens_any_flip(flips) == pytest.approx(2 / 3)
    unrecorded = layer([True, False, False])
    object.__setattr__(unrecorded, "experts_differ", None)
    with pytest.raises(ValueError, match="expert ids"):  # never the logit comparison under the same name
        routing.token_flips([unrecorded])


def test_a_tie_at_the_kth_place_on_one_side_is_a_flip_of_the_experts_that_ran():
    """The trainer has experts 1 and 3 tied at the k-th place and runs 1 (lowest id first); the engine ranks 3 one
    BF16 ULP above 1 and runs 3. No strict order of the logits differs, yet different experts ran: a tie collision."""
    train = torch.tensor([[4.0, 1.0, 0.0, 1.0]], dtype=torch.bfloat16)
    infer = train.clone()
    infer[0, 3] = 1.0 + 2.0**-7  # one BF16 ULP above 1
    assert infer[0, 3] > infer[0, 1]
    infer_ids, train_ids = routing.topk_ids(infer, 2), routing.topk_ids(train, 2)
    assert infer_ids.tolist() == [[0, 3]] and train_ids.tolist() == [[0, 1]]
    r = routing.compare_layer(infer, train, 2, infer_ids=infer_ids, train_ids=train_ids)
    assert not r.set_differs.item()  # the logit comparison alone sees no flip: a tie-break could make them equal
    assert r.experts_differ.item() and r.kth_tie_train.item() and not r.kth_tie_infer.item()
    row = routing.layer_metrics(r)
    assert row["frac_experts_differ"] == 1.0 and row["frac_differ_tie_collision"] == 1.0
    assert row["frac_differ_strict_order"] == 0.0 and row["frac_topk_set_differs"] == 0.0
    assert row["frac_kth_tie_train"] == 1.0 and row["frac_kth_tie_infer"] == 0.0
    assert routing.token_flips([r])[0].tolist() == [1]

    # the same tie on both sides, broken the same way (the same ids, listed in another order): no flip
    same = routing.compare_layer(train, train, 2, infer_ids=train_ids.flip(-1), train_ids=train_ids)
    assert not same.experts_differ.item() and same.kth_tie_infer.item() and same.kth_tie_train.item()
    row = routing.layer_metrics(same)
    assert row["frac_experts_differ"] == 0.0 and row["frac_differ_tie_collision"] == 0.0
    assert routing.token_flips([same])[0].tolist() == [0]


def test_without_ids_the_experts_columns_are_nan_not_the_logit_count():
    infer, train = torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([[1.0, 2.0, 0.0]])
    row = routing.layer_metrics(routing.compare_layer(infer, train, 1))
    assert row["frac_topk_set_differs"] == 1.0
    assert all(math.isnan(row[c]) for c in ("frac_experts_differ", "frac_differ_strict_order",
                                            "frac_differ_tie_collision"))


def test_upstream_flips_by_hand():
    flipped = torch.tensor([False, True, False, False, False, True, False])
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    assert routing.upstream_flips(flipped, seq, scope="position").tolist() == flipped.tolist()
    assert routing.upstream_flips(flipped, seq, scope="prefix").tolist() == [
        False, True, True, False, False, True, False]  # a flip never leaks into the next sequence
    with pytest.raises(ValueError, match="contiguous"):
        routing.upstream_flips(flipped, torch.tensor([0, 0, 1, 1, 0, 2, 2]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.booleans()), min_size=1, max_size=30))
def test_upstream_prefix_matches_a_loop(rows):
    rows = sorted(rows, key=lambda r: r[0])  # contiguous sequences; the order inside each is kept
    seq = torch.tensor([s for s, _ in rows])
    flipped = torch.tensor([f for _, f in rows])
    want, seen = [], {}
    for s, f in rows:
        seen[s] = seen.get(s, False) or f
        want.append(seen[s])
    assert routing.upstream_flips(flipped, seq, scope="prefix").tolist() == want


def test_dlogp_by_upstream_flip_by_hand():
    got = routing.dlogp_by_upstream_flip(torch.tensor([0.1, 0.3, 0.0, 0.2]),
                                         torch.tensor([True, True, False, False]))
    assert got["frac_tokens_upstream_flip"] == 0.5
    assert got["mean_abs_dlogp_upstream_flip"] == pytest.approx(0.2)
    assert got["mean_abs_dlogp_no_upstream_flip"] == pytest.approx(0.1)
    none = routing.dlogp_by_upstream_flip(torch.tensor([0.1]), torch.tensor([False]))
    assert math.isnan(none["mean_abs_dlogp_upstream_flip"])


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([1.0, 2.0]), "tokens, experts"),
    (torch.tensor([[1.0, math.nan]]), "NaN"),
])
def test_bad_logits_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        routing.compare_layer(bad, bad, top_k=1)
    with pytest.raises(ValueError, match="top_k"):
        routing.compare_layer(torch.zeros(1, 2), torch.zeros(1, 2), top_k=3)


@pytest.mark.parametrize("largest, kind", [
    ("noise_train_kernel_frac_tokens_any_flip", "systematic"),  # a kernel swap: the same flips every time
    ("noise_infer_frac_tokens_any_flip", "noise"),  # the engine's own batch change
])
def test_the_routing_ratio_names_the_kind_of_its_floor(largest, kind):
    """The cross-stack flip ratio, like the logprob verdict, says whether the floor it is read against is noise or
    one systematic swap: in summary.csv and in compare's printed row."""
    from rich.table import Table

    from divergence_probe.cli.tables import routing_rows
    from divergence_probe.numerics.tables import ROUTING_NOISE_FLOORS
    from divergence_probe.runs.compare import routing_verdict_columns

    s = {"frac_tokens_any_flip": 0.3, "mean_abs_dlogp_after_flip": 0.1, "mean_abs_dlogp_not_after_flip": 0.01}
    s |= {name: 0.05 for name in ROUTING_NOISE_FLOORS} | {largest: 0.1}
    s |= routing_verdict_columns(s)
    assert s["routing_largest_noise_floor"] == largest and s["routing_noise_floor_kind"] == kind
    table = Table()
    table.add_column("metric")
    table.add_column("value")
    routing_rows(table, s, False)
    printed = dict(zip(table.columns[0]._cells, table.columns[1]._cells))
    assert printed["routed differently / largest routing floor"].endswith(
        f"({ROUTING_NOISE_FLOORS[largest]}: {kind})")
