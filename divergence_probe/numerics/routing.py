"""Routing metrics for mixture-of-experts layers: pure functions from the two sides' router logits and the experts
each side's router returned (no model code).

    from divergence_probe.numerics import routing
    per_layer = [routing.compare_layer(infer_logits[i], train_logits[i], top_k=8,
                                       infer_ids=engine_ids[i], train_ids=trainer_ids[i]) for i in range(layers)]
    rows = [routing.layer_metrics(r) for r in per_layer]            # one routing.csv row per layer
    flips, first = routing.token_flips(per_layer)                   # tokens.csv: routing_flips, first_flip_layer
    upstream = routing.upstream_flips(flips > 0, sequence_ids, scope="prefix")
    summary = routing.dlogp_by_upstream_flip(abs_dlogp, upstream[scoring])   # summary.csv
    # scoring: the rows whose logits score a token (all but each sequence's last); abs_dlogp in that order

Conventions, as in numerics/metrics.py: `infer` is the engine's side, `train` the trainer's. Router logits are
[tokens, experts] in any floating dtype; they are compared in FP64, which holds every BF16/FP16/FP32 value
exactly, so no rounding of ours can make or hide a flip.

The experts that ran. The headline count (`experts_differ`, and token_flips' routing_flips built on it) compares the
expert ids each stack's router returned, the experts each stack then ran: that is what a routing replay (R3) replays
and what moves the output. Both stacks break an exact tie at the k-th place deterministically, each its own way, so
where one side has experts 5 and 9 tied at the k-th place and runs 5 while the other ranks 9 a ULP above 5 and runs 9,
different experts ran though no strict order of the logits differs: a "tie collision". The logit comparison below
explains each difference: a strict order difference (`set_differs`: no tie-break could make the sets equal) or a tie
collision (the sets differ though some tie-break would have made them equal).

Ties in the logit comparison. Both stacks pick experts with torch.topk (transformers on FP32 softmax probabilities, which keep the
order and the ties of the logits; vLLM's CPU router on the BF16 logits themselves, unsorted), and torch.topk
does not specify which of equal values it returns. With BF16 logits, equal values at the k-th place do occur,
so a side's top-k is then a *family* of admissible sets: every expert strictly above the k-th value, plus any
choice among those equal to it. The rule here: two sides' top-k sets differ only if NO tie-break on either side
makes them equal, and their orders differ only if no tie-breaks make the ordered top-k lists equal. So a metric
never reports a flip that is only a tie-break (those are the tie collisions, counted from the ids); the Jaccard index is the largest over tie-breaks. Where a
single canonical pick is needed (replaying routes, a stable expert list), `topk_ids` ranks by value, then by
ascending expert id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# A flip is "near a tie" when the trainer's margin between its k-th and (k+1)-th logit is at most this many BF16
# units in the last place (at the larger of the two magnitudes). One ULP is the smallest gap two distinct BF16
# logits can have: a swap across it needs only a sub-ULP change in the FP32 accumulator before the router GEMM's
# output rounding, which a different reduction order gives on bitwise-equal inputs. A flip across a wider margin
# needs the router's input (the hidden state) to have moved, i.e. mismatch accumulated upstream.
NEAR_TIE_ULPS = 1.0
_BF16_MANTISSA_BITS = 7
_BF16_MIN_SUBNORMAL = 2.0**-133
QUANTILES = (0.1, 0.5, 0.9)


@dataclass(frozen=True)
class LayerRouting:
    """Per-token comparison of one MoE layer's routing; every field is a [tokens] tensor. `experts_differ` is None
    where a side's router ids were not recorded: the logit fields then stand alone, never in its place."""

    set_differs: torch.Tensor  # bool: no tie-break makes the two top-k sets equal
    order_differs: torch.Tensor  # bool: no tie-break makes the two ordered top-k lists equal (implies set_differs)
    jaccard: torch.Tensor  # float64: |A ∩ B| / |A ∪ B| of the top-k sets, largest over tie-breaks
    margin: torch.Tensor  # float64: trainer's k-th minus (k+1)-th largest logit (inf when k == experts)
    near_tie: torch.Tensor  # bool: margin <= NEAR_TIE_ULPS BF16 ULPs (see compare_layer)
    kth_tie_infer: torch.Tensor  # bool: the engine's k-th and (k+1)-th largest logits are equal (a tie-break decides)
    kth_tie_train: torch.Tensor  # bool: the same on the trainer's side
    experts_differ: torch.Tensor | None = None  # bool: the sets of expert ids the two routers returned differ


def _check(logits: torch.Tensor, top_k: int, name: str, finite: bool = True) -> None:
    """Shape and top_k, and (`finite`) no NaN/Inf: that check reads a value back from the device, so a caller that
    checks finiteness elsewhere (the run loop checks every sequence's logits) may skip it."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"{name} must be a floating [tokens, experts] tensor, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in 1..{logits.shape[1]} (the number of experts), got {top_k}")
    if finite and not torch.isfinite(logits).all():
        raise ValueError(f"{name} holds NaN or Inf: routing is undefined")


def topk_ids(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The canonical top-k expert ids [tokens, top_k] (int64), best first: by value, equal values by ascending id.

    A stable descending sort keeps equal values in index order, which is the rule; torch.topk has none.
    """
    _check(logits, top_k, "logits")
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]


def _sure_and_tied(x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks [T, E] of the experts in every admissible top-k (strictly above the k-th value) and of those tied
    with the k-th value (some of which are in), and the k-th value [T]."""
    kth = torch.topk(x, top_k, dim=-1).values[:, -1:]  # the k-th value itself is the same whatever the tie-break
    return x > kth, x == kth, kth[:, 0]


def is_admissible_topk(logits: torch.Tensor, ids: torch.Tensor, *, check_finite: bool = True) -> torch.Tensor:
    """Per token [T] bool: are `ids` ([T, k], any order) a top-k of `logits` under some tie-break?

    This is how an engine's own record of its routes (vLLM's routed_experts) is checked against the router
    logits hooked in the same forward: any admissible set is a faithful record, whatever order it lists.
    """
    top_k = ids.shape[1]
    _check(logits, top_k, "logits", check_finite)
    x = logits.double()
    sure, tied, _ = _sure_and_tied(x, top_k)
    chosen = torch.zeros_like(sure)
    chosen.scatter_(1, ids.long(), True)
    distinct = chosen.sum(-1) == top_k  # a repeated id would leave fewer than k experts
    return distinct & ~(sure & ~chosen).any(-1) & ~(chosen & ~(sure | tied)).any(-1)


def kth_tie(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per token [T] bool: is the k-th largest logit equal to the (k+1)-th, so that which experts run is decided by
    the stack's tie-break, not by the logits (never, when every expert is chosen)."""
    if top_k >= logits.shape[1]:
        return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    values = torch.topk(logits, top_k + 1, dim=-1).values
    return values[:, -2] == values[:, -1]


def ids_differ(infer_ids: torch.Tensor, train_ids: torch.Tensor) -> torch.Tensor:
    """Per token [T] (or [..., T]) bool: do the two [T, k] ([..., T, k]) lists of expert ids name different sets (the
    order is ignored: it carries no meaning for which experts run)."""
    if infer_ids.shape != train_ids.shape or infer_ids.dim() < 2:
        raise ValueError(f"the two sides' expert ids differ in shape: {tuple(infer_ids.shape)} vs "
                         f"{tuple(train_ids.shape)}")
    a = infer_ids.long().sort(dim=-1).values
    b = train_ids.long().to(a.device).sort(dim=-1).values
    return (a != b).any(dim=-1)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of BF16 values at |x| (FP64): 2^(exponent - 7) for normal x, the subnormal step near 0."""
    _, exponent = torch.frexp(x.double().abs())  # |x| = m * 2^e with m in [0.5, 1): the binade is [2^(e-1), 2^e)
    ulp = torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 1 - _BF16_MANTISSA_BITS)
    return ulp.clamp_min(_BF16_MIN_SUBNORMAL)


def compare_layer(
    infer: torch.Tensor, train: torch.Tensor, top_k: int, *, near_tie_ulps: float = NEAR_TIE_ULPS,
    check_finite: bool = True, infer_ids: torch.Tensor | None = None, train_ids: torch.Tensor | None = None,
) -> LayerRouting:
    """Compare one layer's routing token by token; the tie rule is the module docstring's. `infer_ids`,
    `train_ids` ([T, k]): the experts each side's router returned; with both, `experts_differ` is set.

    Set: for each side the admissible top-k sets are S ∪ (a choice among the tied T), S the sure experts. The
    largest overlap over tie-breaks is reached greedily (an expert sure on one side and tied on the other costs
    one choice on one side; one tied on both costs a choice on each), and the sets can be made equal iff that
    overlap is k. Order: when the sets can be equal, the ordered lists can be too iff no two experts sure on
    either side are in strictly opposite order on the two sides (experts tied at the k-th place on both sides
    sit last on both, so they never reverse; and with no strict reversal, ranking by one side's value and then
    by the other's is an order both admit).
    """
    _check(infer, top_k, "infer", check_finite)
    _check(train, top_k, "train", check_finite)
    if infer.shape != train.shape:
        raise ValueError(f"infer and train router logits differ in shape: {tuple(infer.shape)} vs "
                         f"{tuple(train.shape)}")
    a, b = infer.double(), train.double()
    sure_a, tied_a, _ = _sure_and_tied(a, top_k)
    sure_b, tied_b, kth_b = _sure_and_tied(b, top_k)
    left_a, left_b = top_k - sure_a.sum(-1), top_k - sure_b.sum(-1)  # choices each side makes among its ties
    take_b = torch.minimum((sure_a & tied_b).sum(-1), left_b)
    take_a = torch.minimum((tied_a & sure_b).sum(-1), left_a)
    take_both = torch.minimum((tied_a & tied_b).sum(-1), torch.minimum(left_a - take_a, left_b - take_b))
    overlap = (sure_a & sure_b).sum(-1) + take_a + take_b + take_both
    set_differs = overlap < top_k
    jaccard = overlap.double() / (2 * top_k - overlap).double()

    # Strict reversals among the experts sure on either side; they are all within the union of the two sides'
    # top-k by torch.topk (any tie-break keeps every sure expert), so 2k columns suffice instead of all E.
    cols = torch.cat([torch.topk(a, top_k, dim=-1).indices, torch.topk(b, top_k, dim=-1).indices], dim=-1)
    in_l = (sure_a | sure_b).gather(1, cols)
    ga, gb = a.gather(1, cols), b.gather(1, cols)
    da, db = ga[:, :, None] - ga[:, None, :], gb[:, :, None] - gb[:, None, :]  # [T, 2k, 2k]
    reversed_pair = ((da * db) < 0) & in_l[:, :, None] & in_l[:, None, :]
    order_differs = set_differs | reversed_pair.flatten(1).any(-1)

    if top_k < b.shape[1]:
        below = torch.topk(b, top_k + 1, dim=-1).values[:, -1]
        margin = kth_b - below
        scale = bf16_ulp(torch.maximum(kth_b.abs(), below.abs()))
        near_tie = margin <= near_tie_ulps * scale
    else:  # every expert is chosen: nothing can flip
        margin = torch.full_like(kth_b, math.inf)
        near_tie = torch.zeros_like(set_differs)
    both = infer_ids is not None and train_ids is not None
    return LayerRouting(set_differs=set_differs, order_differs=order_differs, jaccard=jaccard, margin=margin,
                        near_tie=near_tie, kth_tie_infer=kth_tie(a, top_k), kth_tie_train=kth_tie(b, top_k),
                        experts_differ=ids_differ(infer_ids, train_ids).to(a.device) if both else None)


def _quantiles(x: torch.Tensor, prefix: str) -> dict[str, float]:
    if x.numel() == 0:
        return {f"{prefix}_q{round(q * 100)}": math.nan for q in QUANTILES}
    values = torch.quantile(x, torch.tensor(QUANTILES, dtype=x.dtype))
    return {f"{prefix}_q{round(q * 100)}": v for q, v in zip(QUANTILES, values.tolist())}


def _frac(mask: torch.Tensor | None) -> float:
    return mask.double().mean().item() if mask is not None and mask.numel() else math.nan


def layer_metrics(r: LayerRouting) -> dict[str, float]:
    """One routing.csv row (without the layer index).

    frac_experts_differ is the share of tokens whose two routers returned different expert sets (NaN where a side's
    ids were not recorded); it splits into frac_differ_strict_order (the logits' strict order differs: no tie-break
    could make the sets equal) and frac_differ_tie_collision (an exact tie at the k-th place on a side, broken
    otherwise than the other side's order). frac_kth_tie_infer / _train: how often a side's k-th place is an exact
    tie at all. The frac_topk_* columns and the margins are the logit comparison (module docstring).

    frac_flipped_near_tie is the share of this layer's flipped tokens (set differs) whose trainer-side margin
    is a near tie (NaN if none flipped): how much of the flipping a last-bit rounding alone can explain. The
    margin quantiles are in logit units, of the flipped and of the unflipped tokens (NaN where there are none).
    """
    flipped = r.set_differs
    n_flipped = int(flipped.sum())
    ran = r.experts_differ
    row = {
        "tokens": int(flipped.numel()),
        "frac_experts_differ": _frac(ran),
        "frac_differ_strict_order": _frac(None if ran is None else ran & flipped),
        "frac_differ_tie_collision": _frac(None if ran is None else ran & ~flipped),
        "frac_kth_tie_infer": _frac(r.kth_tie_infer),
        "frac_kth_tie_train": _frac(r.kth_tie_train),
        "frac_topk_set_differs": flipped.double().mean().item(),
        "frac_topk_order_differs": r.order_differs.double().mean().item(),
        "mean_jaccard": r.jaccard.mean().item(),
        "frac_flipped_near_tie": (r.near_tie & flipped).sum().item() / n_flipped if n_flipped else math.nan,
    }
    row |= _quantiles(r.margin[flipped], "margin_flipped")
    row |= _quantiles(r.margin[~flipped], "margin_unflipped")
    return row


def token_flips(layers: list[LayerRouting]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, across the MoE layers in order: routing_flips (in how many layers the two stacks ran different
    experts, int64) and first_flip_layer (the index into `layers` of the first; -1 if none). The experts that ran,
    never the logit comparison in their place: a layer without both sides' ids is an error."""
    if not layers:
        raise ValueError("no MoE layers to combine")
    if any(r.experts_differ is None for r in layers):
        raise ValueError("routing flips count the experts each stack ran: a layer lacks a side's expert ids")
    differs = torch.stack([r.experts_differ for r in layers], dim=0)  # [layers, T]
    flips = differs.sum(0)
    first = torch.where(flips > 0, differs.int().argmax(0), torch.full_like(flips, -1))  # argmax: the first True
    return flips, first


def upstream_flips(flipped: torch.Tensor, sequence_ids: torch.Tensor, *, scope: str = "prefix") -> torch.Tensor:
    """Which rows have a routing flip upstream of the logits they produce, [T] bool.

    Rows are token positions, each sequence's rows contiguous and in position order. In a causal model the
    logits at row t (which score the token at position t+1) depend on the routes of positions <= t of the same
    sequence, through attention. scope="position": a flip at row t itself, in any layer. scope="prefix": a flip
    at row t or any earlier row of its sequence, the full causal cone. (A flip in layer l at row t also feeds
    layers > l at row t, so both scopes cover "any layer".)
    """
    if flipped.shape != sequence_ids.shape or flipped.dim() != 1:
        raise ValueError("flipped and sequence_ids must both be [tokens]")
    if scope == "position":
        return flipped.bool().clone()
    if scope != "prefix":
        raise ValueError(f"scope must be 'position' or 'prefix', got {scope!r}")
    n = flipped.numel()
    if n == 0:
        return flipped.bool().clone()
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = sequence_ids[1:] != sequence_ids[:-1]
    if torch.unique(sequence_ids).numel() != int(starts.sum()):
        raise ValueError("each sequence's rows must be contiguous")
    counts = torch.cumsum(flipped.long(), 0)
    # flips before each sequence's first row, broadcast over the sequence: subtract them to count within it
    before = torch.where(starts, counts - flipped.long(), torch.zeros_like(counts))
    before = torch.cummax(torch.where(starts, before, torch.full_like(before, -1)), 0).values
    return (counts - before) > 0


def dlogp_by_upstream_flip(abs_dlogp: torch.Tensor, upstream: torch.Tensor) -> dict[str, float]:
    """Mean |Δlogp| of the scored tokens with and without an upstream flip (NaN for an empty group), and the
    share with one. abs_dlogp[t] is the token predicted by row t's logits, so it lines up with `upstream`."""
    if abs_dlogp.shape != upstream.shape:
        raise ValueError("abs_dlogp and upstream must have the same shape")
    x, up = abs_dlogp.double(), upstream.bool()
    n_up = int(up.sum())
    n_down = up.numel() - n_up
    return {
        "frac_tokens_upstream_flip": n_up / up.numel() if up.numel() else math.nan,
        "mean_abs_dlogp_upstream_flip": x[up].mean().item() if n_up else math.nan,
        "mean_abs_dlogp_no_upstream_flip": x[~up].mean().item() if n_down else math.nan,
    }


def frac_tokens_any_flip(flips: torch.Tensor) -> float:
    """The share of token positions whose routing flips in at least one layer (flips: token_flips' first)."""
    return (flips > 0).double().mean().item() if flips.numel() else math.nan
