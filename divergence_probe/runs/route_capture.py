"""A run's routing, for mixture-of-experts models: both stacks' router logits compared token by token once per
inference batch, the engine's own routes checked against its logits and kept for a replay into the trainer.

    capture = RouteCapture(pairing, num_layers=L, top_k=k, metrics=True, records=True)
    ... the run loop parks, pairs and finishes sequences through `capture` as through the pairing ...
    with probe.train.routes_replayed(capture.routes): ...     # --align routing: the trainer takes the engine's experts
    result = capture.result()                                 # routing.csv, tokens.csv's columns, summary.csv's

It wraps the run's tap capture (capture.TapPairing): `router_logits` taps go on to be diffed like any tap and are
also compared as routing (numerics/routing.py: which experts each side picks, under its tie rule). Which experts each stack
RAN is read from the ids its router returned: the engine's `expert_ids` record below, and the trainer's `expert_ids`
(transformers' router returns (logits, weights, ids); engines/hf/trainer.py hands the ids over as the same record). A side
that hands over no ids leaves the experts columns empty and says so (`ids_recorded`), never a logit-based count in
their place. The engine's route records
(taps.ROUTE_RECORDS: the ids and weights its router returned, what its experts ran with and what vLLM's
enable_return_routed_experts records) never reach the pairing: they are checked, kept for the trainer's replay of
the same sequence, and dropped when its batch is done.

Routing is compared per inference batch, not per sequence and layer: when the trainer has run the batch's last
sequence (the run loop names them with `add_sequences`; without it, each sequence is a batch of its own), every
layer's router logits of every sequence of the batch are stacked into one [layers x rows, experts] pair per side,
and the finiteness check, the check of the engine's routes and the comparison run on those stacks (numerics/routing.py works
row by row, so the results are those of the per-layer calls, bit for bit), all read back to the host at once. So a
batch costs a fixed number of small ops (up to `rows_per_call`'s size) and one device->host read-back however many
sequences and layers it holds:
done per sequence and layer, those small ops (kernel launches on a GPU) and read-backs were most of what the taps
added to a MoE compare (docs/benchmarks.md). The batch's router logits stay referenced until then: the engine's are
valid until its next call (after the batch), and the trainer's have one feature per expert, a small fraction of the
taps the batch parks. Nothing outlives the batch but a few numbers per token and layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..numerics import routing
from ..errors import NumericsError, StackError
from ..taps import ROUTE_RECORDS, TapKey

ROUTING_COLUMNS = ["layer", "tokens", "frac_experts_differ", "frac_differ_strict_order", "frac_differ_tie_collision",
                   "frac_kth_tie_infer", "frac_kth_tie_train", "frac_topk_set_differs", "frac_topk_order_differs",
                   "mean_jaccard", "frac_flipped_near_tie", "margin_flipped_q10", "margin_flipped_q50", "margin_flipped_q90",
                   "margin_unflipped_q10", "margin_unflipped_q50", "margin_unflipped_q90"]
TOKEN_ROUTING_COLUMNS = ["routing_flips", "first_flip_layer", "upstream_flip"]
SUMMARY_ROUTING_COLUMNS = ["frac_tokens_any_flip", "frac_tokens_after_flip", "mean_abs_dlogp_after_flip",
                           "mean_abs_dlogp_not_after_flip", "frac_tokens_upstream_flip", "mean_abs_dlogp_upstream_flip",
                           "mean_abs_dlogp_no_upstream_flip"]
# Rows (token-layers) per routing.compare_layer call. On an accelerator, where each op is a kernel launch, as many as
# memory allows: the stacked logits and compare_layer's FP64 intermediates grow with rows x experts and rows x
# (2 top_k)^2, so ROWS_PER_CALL, what one long sequence's layer took when each was compared on its own. On the CPU an
# op costs little to call, but torch spreads one of more than SERIAL_ELEMENTS elements (its intra-op grain size,
# at::internal::GRAIN_SIZE) over its threads, and on a CPU that other work shares, those threads wait on each other
# longer than the work takes: calls there stay under it (whole sequences' layers, as many as fit).
ROWS_PER_CALL = 1 << 14
SERIAL_ELEMENTS = 1 << 15


def rows_per_call(logits: torch.Tensor, top_k: int) -> int:
    """How many rows of router logits like `logits` ([tokens, experts], on their device) one comparison call takes."""
    if logits.device.type != "cpu":
        return ROWS_PER_CALL
    return max(1, SERIAL_ELEMENTS // max(logits.shape[1], (2 * top_k) ** 2))


class RouteRecordError(StackError):
    """The engine's experts for a token are not a top-k of its own router logits: what an RL framework would replay
    from the engine's record is then not what its router computed."""


@dataclass(frozen=True)
class _Sequence:
    prompt_id: int
    sample_id: int | None


class RouteCapture:
    """The run loop's capture (park/pair/finish_prompt, as capture.TapPairing) with routing on top; `inner` is the tap
    capture it hands everything else to. `metrics`: compare both sides' router_logits (they must be among the inner
    capture's taps). `records`: the engine hands over its routes (taps.ROUTE_RECORDS), checked against its router
    logits where both are captured, and kept for `routes` until the sequence's batch is done."""

    def __init__(self, inner, *, num_layers: int, top_k: int, metrics: bool, records: bool) -> None:
        self.inner, self.num_layers, self.top_k = inner, num_layers, top_k
        self.metrics, self.records = metrics, records
        self._infer: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)  # key -> layer -> engine router logits
        self._train: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
        self._routes: dict[int, dict[tuple[str, int], torch.Tensor]] = defaultdict(dict)  # key -> (record, layer)
        self._train_ids: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)  # key -> layer -> trainer's expert ids
        self.ids_recorded = {"infer": True, "train": True}  # did every batch's sequences come with the side's ids
        self._layers: list[list[routing.LayerRouting]] = [[] for _ in range(num_layers)]  # per layer, per batch
        self._flips: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}  # key -> (routing_flips, first_flip_layer)
        self._sequences: dict[int, _Sequence] = {}
        self._waiting: set[int] = set()  # the batch's sequences the trainer has not finished yet
        self._finished: list[int] = []  # those it has, in run order, whose routing is not compared yet
        self.records_checked = 0  # token-layers whose engine routes were checked against its router logits

    # ------------------------------------------------------------------ the capture protocol (capture.TapPairing)
    def park(self, key: int, tap, tensor: torch.Tensor) -> None:
        if isinstance(tap, TapKey):
            if tap.name in ROUTE_RECORDS:
                if self.records:
                    self._routes[key][(tap.name, tap.layer)] = tensor
                self.inner.park_route(key, tap, tensor)
                return
            if tap.name == "router_logits" and self.metrics:
                self._infer[key][tap.layer] = tensor
        self.inner.park(key, tap, tensor)

    def pair(self, key: int, tap: TapKey, tensor: torch.Tensor) -> None:
        if tap.name in ROUTE_RECORDS:  # the trainer's own choice: compared, never diffed as a tap
            if tap.name == "expert_ids" and self.metrics:
                self._train_ids[key][tap.layer] = tensor
            return
        if tap.name == "router_logits" and self.metrics:
            self._train[key][tap.layer] = tensor
        self.inner.pair(key, tap, tensor)

    def add_sequences(self, sequences) -> None:
        """The sequences of an inference batch (compare.ScoredSequence): which prompt and sample each key is. Their
        routing is compared when the last of them is finished."""
        for seq in sequences:
            self._sequences[seq.key] = _Sequence(seq.prompt_id, seq.sample_id)
        self._waiting = {seq.key for seq in sequences}
        self.inner.add_sequences(sequences)

    def finish_prompt(self, key: int) -> None:
        infer, train = self._infer.get(key, {}), self._train.get(key, {})
        if self.metrics and (len(infer) != self.num_layers or len(train) != self.num_layers):
            raise StackError(f"sequence {key}: router logits of {len(infer)} (inference) and {len(train)} "
                             f"(training) of {self.num_layers} layers were captured; report this as a bug")
        self.inner.finish_prompt(key)
        self._finished.append(key)
        self._waiting.discard(key)
        if not self._waiting:  # the batch's last sequence (or one outside any batch the run loop named)
            self._compare_batch()

    def _compare_batch(self) -> None:
        """The finished sequences' routing, checked and compared on one stack of every layer of all of them per side
        (module docstring), read back once; then their router logits and routes are dropped. Non-finite logits are
        an error before any route check: they are an overflow, not a bad record."""
        keys, self._finished = self._finished, []
        infer = [self._infer.pop(key, {}) for key in keys]
        train = [self._train.pop(key, {}) for key in keys]
        routes = [self._routes.pop(key, {}) for key in keys]
        train_ids = [self._train_ids.pop(key, {}) for key in keys]
        if not self.metrics:
            return
        layers = range(self.num_layers)
        checked = self.records and any(routes)  # the engine's routes against its router logits
        self.ids_recorded["infer"] &= bool(checked)
        self.ids_recorded["train"] &= all(len(ids) == self.num_layers for ids in train_ids)
        both = self.ids_recorded["infer"] and self.ids_recorded["train"]  # the experts each stack ran
        rows = [sequence[0].shape[0] for sequence in infer]
        for key, i, t, r, tr in zip(keys, infer, train, routes, train_ids):
            for layer in layers:
                if i[layer].shape != t[layer].shape or i[layer].shape[0] != i[0].shape[0]:
                    raise StackError(f"sequence {key}, layer {layer}: router logits of {tuple(i[layer].shape)} "
                                     f"(inference) and {tuple(t[layer].shape)} (training); report this as a bug")
                ids = r.get(("expert_ids", layer)) if checked else None
                if checked and ids is None:
                    raise StackError(f"sequence {key}, layer {layer}: the engine handed over no routes; report this "
                                     "as a bug")
                if ids is not None and ids.shape[0] != i[layer].shape[0]:
                    raise RouteRecordError(f"the engine routed {ids.shape[0]} rows of sequence {key} in layer {layer} "
                                           f"but computed router logits for {i[layer].shape[0]}: its router ran on "
                                           "other rows than its gate (chunked MoE?); routing cannot be compared")
                own = tr.get(layer) if both else None
                if own is not None and own.shape != (t[layer].shape[0], self.top_k):
                    raise StackError(f"sequence {key}, layer {layer}: the trainer's router returned expert ids of "
                                     f"{tuple(own.shape)} for {t[layer].shape[0]} rows; report this as a bug")
        # the rows of every (layer, sequence), layer-major (each layer's rows are the batch's sequences in run order),
        # stacked per side in calls of whole sequences' layers, at most `limit` rows unless one alone is more
        pieces = [(layer, j) for layer in layers for j in range(len(keys))]
        limit = rows_per_call(infer[0][0], self.top_k)
        calls, size = [], limit
        for layer, j in pieces:
            if size + rows[j] > limit:
                calls.append([])
                size = 0
            calls[-1].append((layer, j))
            size += rows[j]
        parts = []
        for call in calls:
            x = torch.cat([infer[j][layer] for layer, j in call])
            y = torch.cat([train[j][layer] for layer, j in call]).to(x.device)
            ids = torch.cat([routes[j][("expert_ids", layer)] for layer, j in call]).to(x.device) if checked else None
            own = torch.cat([train_ids[j][layer] for layer, j in call]).to(x.device) if both else None
            c = routing.compare_layer(x, y, self.top_k, check_finite=False,  # finiteness: below, with the routes
                                      infer_ids=ids if both else None, train_ids=own)
            columns = [c.set_differs, c.order_differs, c.jaccard, c.margin, c.near_tie, c.kth_tie_infer,
                       c.kth_tie_train, *([c.experts_differ] if both else []), torch.isfinite(x).all(-1),
                       torch.isfinite(y).all(-1)]
            if checked:
                columns.append(routing.is_admissible_topk(x, ids, check_finite=False))
            parts.append(torch.stack([col.double() for col in columns]))  # FP64 holds the bools and FP64 columns
        host = (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).cpu()  # the batch's one read-back
        n = sum(rows)
        fields = 8 if both else 7
        flags = host[fields:].bool()  # [finite infer, finite train, (admissible)] x [layers x rows]
        if not flags.all():
            self._raise_first(keys, rows, routes, *flags)
        if checked:
            self.records_checked += flags.shape[1]
        # per layer (views of the host copy, in the dtypes compare_layer returns): FP64 for jaccard and margin,
        # bools for the rest, each converted once for every layer
        names = ["set_differs", "order_differs", "jaccard", "margin", "near_tie", "kth_tie_infer", "kth_tie_train",
                 "experts_differ"][:fields]
        flags_at = [j for j, name in enumerate(names) if name not in ("jaccard", "margin")]
        flagged = host[flags_at].bool().view(len(flags_at), self.num_layers, n)
        per_field = dict(zip([names[j] for j in flags_at], flagged))
        per_field |= dict(zip(("jaccard", "margin"), host[2:4].view(2, self.num_layers, n)))
        per_layer = [routing.LayerRouting(**dict(zip(per_field, values)))
                     for values in zip(*(f.unbind() for f in per_field.values()))]
        for kept, r in zip(self._layers, per_layer):
            kept.append(r)
        if not self.ids_recorded["infer"] or not self.ids_recorded["train"]:
            self._flips.update(dict.fromkeys(keys))  # which experts ran is unknown: no flips counted in its place
            return
        flips, first = routing.token_flips(per_layer)
        for key, f, g in zip(keys, flips.split(rows), first.split(rows)):
            self._flips[key] = (f, g)

    def _raise_first(self, keys, rows, routes, finite_a, finite_b, ok=None) -> None:
        """The error of the first sequence, in run order, whose router logits are not finite or whose engine routes
        are not a top-k of them (the flags are [layers x rows] as _compare_batch stacks them, on the host)."""
        n = sum(rows)
        for key, start, length, r in zip(keys, [sum(rows[:j]) for j in range(len(rows))], rows, routes):
            at = [slice(layer * n + start, layer * n + start + length) for layer in range(self.num_layers)]
            for side, finite in (("inference", finite_a), ("training", finite_b)):
                for layer, span in enumerate(at):
                    if not finite[span].all():
                        raise NumericsError(
                            f"the {side} stack's router logits of layer {layer} hold NaN/Inf (sequence {key}); the "
                            "weights overflow in this dtype (try --dtype float32) or the checkpoint is broken")
            bad = [(layer, (~ok[span]).nonzero()) for layer, span in enumerate(at)] if ok is not None else []
            for layer, tokens in bad:
                if len(tokens):
                    token, ids = int(tokens[0, 0]), r[("expert_ids", layer)]
                    raise RouteRecordError(
                        f"the engine sent token {token} of sequence {key} in layer {layer} to experts "
                        f"{sorted(ids[token].tolist())}, which are not a top-{ids.shape[1]} of its own router "
                        "logits: the routes vLLM records (enable_return_routed_experts) are not what its router "
                        "computed")
        raise StackError("a routing check failed for no sequence; report this as a bug")

    def __getattr__(self, name):  # the inner capture's own results (stats, a grafting capture's tables)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ the engine's routes
    def routes(self, key: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's experts for a sequence's tokens in one layer: (ids [T, k], weights [T, k]), as its router
        returned them (the order of the ids carries no meaning: vLLM's CPU router does not sort them)."""
        routes = self._routes.get(key, {})
        ids, weights = routes.get(("expert_ids", layer)), routes.get(("expert_weights", layer))
        if ids is None or weights is None:
            raise StackError(f"the engine handed over no routes for sequence {key}, layer {layer}: nothing to replay; "
                             "report this as a bug")
        return ids.long(), weights

    # ------------------------------------------------------------------ results
    def result(self) -> "RunRouting | None":
        """The run's routing comparison (on the host, where each batch's was read back); None when router logits were
        not compared."""
        if self._finished or self._waiting:  # a batch never completed: its routing would be silently missing
            raise StackError(f"routing: {len(self._finished) + len(self._waiting)} sequence(s) of the last batch were "
                             "never compared (the run loop did not finish them); report this as a bug")
        if not self.metrics or not self._flips:
            return None
        layers = [cat_routing(per_batch) for per_batch in self._layers]
        return RunRouting(layers, dict(self._flips), dict(self._sequences), self.top_k, self.records_checked,
                          dict(self.ids_recorded))


def cat_routing(parts: list[routing.LayerRouting]) -> routing.LayerRouting:
    """One layer's comparisons of several sequences (or batches) as one, on the host; experts_differ only where every
    part has it (a part without a side's ids leaves the whole layer's unknown)."""
    fields = {f.name: [getattr(p, f.name) for p in parts] for f in dataclasses.fields(routing.LayerRouting)}
    return routing.LayerRouting(**{name: None if any(v is None for v in values) else torch.cat(values).cpu()
                                   for name, values in fields.items()})


def routing_table(layers: list[routing.LayerRouting]) -> pd.DataFrame:
    """routing.csv's rows (also local_routing.csv's, runs/graft.py): one per MoE layer, routing.layer_metrics."""
    rows = [{"layer": i, **routing.layer_metrics(r)} for i, r in enumerate(layers)]
    return pd.DataFrame(rows, columns=ROUTING_COLUMNS)


@dataclass
class RunRouting:
    """Both stacks' routing over a run: per layer (every routed row of every sequence, in run order) and per token."""

    layers: list[routing.LayerRouting]
    flips: dict[int, tuple[torch.Tensor, torch.Tensor] | None]  # key -> (routing_flips, first_flip_layer) per row
    sequences: dict[int, _Sequence]
    top_k: int
    records_checked: int
    ids_recorded: dict[str, bool]  # side -> did its router hand over the expert ids it returned, every sequence

    @property
    def experts_known(self) -> bool:
        """Are the experts each stack ran known (both sides' ids recorded)? Without, no flip is counted at all."""
        return all(self.ids_recorded.values())

    def table(self) -> pd.DataFrame:
        """routing.csv: one row per MoE layer (routing.layer_metrics)."""
        return routing_table(self.layers)

    def token_columns(self, tokens: pd.DataFrame) -> pd.DataFrame:
        """tokens.csv with routing_flips and first_flip_layer (at the token's own position: how many layers, and the
        first, where the two stacks sent this token to different experts; empty where the engine never ran the
        token, a sampled sequence's last) and upstream_flip (a flip at any earlier position of its sequence, in any
        layer: in the causal cone of the logits that scored this token). All three empty where a side's ids were not
        recorded."""
        if not self.experts_known:
            return tokens.assign(routing_flips=pd.array([pd.NA] * len(tokens), dtype="Int64"),
                                 first_flip_layer=pd.array([pd.NA] * len(tokens), dtype="Int64"),
                                 upstream_flip=pd.array([pd.NA] * len(tokens), dtype="boolean"))
        parts = []
        for key, (flips, first) in self.flips.items():
            seq = self.sequences[key]
            n = len(flips)
            positions = np.arange(1, n + 1)  # tokens.csv rows: positions 1.. of the sequence (n rows at most)
            # a flip at rows 0..p-1, for the token at position p: row p-1's causal cone (one sequence's rows)
            upstream = routing.upstream_flips(flips > 0, torch.zeros(n, dtype=torch.long), scope="prefix").numpy()
            frame = {"prompt_id": seq.prompt_id, "position": positions,
                     "routing_flips": pd.array(np.append(flips.numpy()[1:], [0])[: n], dtype="Int64"),
                     "first_flip_layer": pd.array(np.append(first.numpy()[1:], [0])[: n], dtype="Int64"),
                     "upstream_flip": upstream}
            if seq.sample_id is not None:
                frame["sample_id"] = seq.sample_id
            part = pd.DataFrame(frame)
            part.loc[part.position >= n, ["routing_flips", "first_flip_layer"]] = pd.NA  # past the fed rows
            parts.append(part)
        on = ["prompt_id", "sample_id", "position"] if "sample_id" in tokens else ["prompt_id", "position"]
        merged = tokens.merge(pd.concat(parts, ignore_index=True), on=on, how="left", validate="one_to_one")
        if merged["upstream_flip"].isna().any():
            raise StackError("a scored token has no routing comparison; report this as a bug")
        merged["upstream_flip"] = merged["upstream_flip"].astype(bool)
        return merged

    def summary(self, tokens: pd.DataFrame) -> dict:
        """summary.csv's routing columns. `tokens`: the rows the summary describes, with token_columns' columns.
        frac_tokens_any_flip counts every routed position; the |Δlogp| columns split the scored tokens by whether the
        position just before them (whose logits scored them) flipped in some layer ("after_flip"), and by a flip
        anywhere upstream in their sequence ("upstream_flip"). All NaN where a side's ids were not recorded."""
        if not self.experts_known:
            return dict.fromkeys(SUMMARY_ROUTING_COLUMNS, math.nan)
        flips = torch.cat([f for f, _ in self.flips.values()])
        abs_dlogp = torch.tensor(tokens["delta_logprob"].abs().to_numpy(), dtype=torch.float64)
        after = self._after_flip(tokens)
        upstream = torch.tensor(tokens["upstream_flip"].to_numpy(), dtype=torch.bool)
        row = {"frac_tokens_any_flip": routing.frac_tokens_any_flip(flips)}
        at = routing.dlogp_by_upstream_flip(abs_dlogp, after)
        row |= {"frac_tokens_after_flip": at["frac_tokens_upstream_flip"],
                "mean_abs_dlogp_after_flip": at["mean_abs_dlogp_upstream_flip"],
                "mean_abs_dlogp_not_after_flip": at["mean_abs_dlogp_no_upstream_flip"]}
        return row | routing.dlogp_by_upstream_flip(abs_dlogp, upstream)

    def _after_flip(self, tokens: pd.DataFrame) -> torch.Tensor:
        """Per token row: did the position before it (the row whose logits scored it) flip in some layer."""
        flipped = {}
        for key, (flips, _) in self.flips.items():
            seq = self.sequences[key]
            flipped[(seq.prompt_id, seq.sample_id)] = flips.numpy() > 0
        samples = tokens["sample_id"] if "sample_id" in tokens else pd.Series([None] * len(tokens), index=tokens.index)
        out = [flipped[(p, None if s is None or pd.isna(s) else int(s))][pos - 1]
               for p, s, pos in zip(tokens["prompt_id"], samples, tokens["position"])]
        return torch.tensor(out, dtype=torch.bool)

    def manifest(self) -> dict:
        unknown = [{"infer": "inference", "train": "training"}[side] for side, ok in self.ids_recorded.items() if not ok]
        return {"top_k": self.top_k,
                "flips_count": "the expert ids each stack's router returned (the experts it ran)",
                "expert_ids_recorded": dict(self.ids_recorded),
                **({"experts_not_compared": f"the {' and '.join(unknown)} stack handed over no expert ids: "
                                            "frac_experts_differ, routing_flips and frac_tokens_any_flip are empty"}
                   if unknown else {}),
                "tie_rule": "logit comparison: two sides' top-k differ only if no tie-break on either side makes them "
                            "equal; ids that differ where a tie-break could have made them equal are tie collisions "
                            "(numerics/routing.py)",
                "near_tie_ulps": routing.NEAR_TIE_ULPS,
                "engine_routes_checked_token_layers": self.records_checked}
