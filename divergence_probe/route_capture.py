"""A run's routing, for mixture-of-experts models: both stacks' router logits compared token by token as each sequence
finishes, the engine's own routes checked against its logits and kept for a replay into the trainer.

    capture = RouteCapture(pairing, num_layers=L, top_k=k, metrics=True, records=True)
    ... the run loop parks, pairs and finishes sequences through `capture` as through the pairing ...
    with probe.train.routes_replayed(capture.routes): ...     # --align routing: the trainer takes the engine's experts
    result = capture.result()                                 # routing.csv, tokens.csv's columns, summary.csv's

It wraps the run's tap capture (capture.TapPairing): `router_logits` taps go on to be diffed like any tap and are
also compared as routing (routing.py: which experts each side picks, under its tie rule). The engine's route records
(taps.ROUTE_RECORDS: the ids and weights its router returned, what its experts ran with and what vLLM's
enable_return_routed_experts records) never reach the pairing: they are checked, kept for the trainer's replay of
the same sequence, and dropped when the sequence is done. Like the pairing, nothing outlives its sequence but a few
numbers per token and layer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from . import routing
from .errors import NumericsError, StackError
from .taps import ROUTE_RECORDS, TapKey

ROUTING_COLUMNS = ["layer", "tokens", "frac_topk_set_differs", "frac_topk_order_differs", "mean_jaccard",
                   "frac_flipped_near_tie", "margin_flipped_q10", "margin_flipped_q50", "margin_flipped_q90",
                   "margin_unflipped_q10", "margin_unflipped_q50", "margin_unflipped_q90"]
TOKEN_ROUTING_COLUMNS = ["routing_flips", "first_flip_layer", "upstream_flip"]


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
    logits where both are captured, and kept for `routes` until the sequence is done."""

    def __init__(self, inner, *, num_layers: int, top_k: int, metrics: bool, records: bool) -> None:
        self.inner, self.num_layers, self.top_k = inner, num_layers, top_k
        self.metrics, self.records = metrics, records
        self._infer: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)  # key -> layer -> engine router logits
        self._train: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
        self._routes: dict[int, dict[tuple[str, int], torch.Tensor]] = defaultdict(dict)  # key -> (record, layer)
        self._layers: list[list[routing.LayerRouting]] = [[] for _ in range(num_layers)]  # per layer, per sequence
        self._flips: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (routing_flips, first_flip_layer)
        self._sequences: dict[int, _Sequence] = {}
        self.records_checked = 0  # token-layers whose engine routes were checked against its router logits

    # ------------------------------------------------------------------ the capture protocol (capture.TapPairing)
    def park(self, key: int, tap, tensor: torch.Tensor) -> None:
        if isinstance(tap, TapKey):
            if tap.name in ROUTE_RECORDS:
                if self.records:
                    self._routes[key][(tap.name, tap.layer)] = tensor
                if hasattr(self.inner, "park_route"):  # a grafting capture replays the experts on them (local.py)
                    self.inner.park_route(key, tap, tensor)
                return
            if tap.name == "router_logits" and self.metrics:
                self._infer[key][tap.layer] = tensor
        self.inner.park(key, tap, tensor)

    def pair(self, key: int, tap: TapKey, tensor: torch.Tensor) -> None:
        if tap.name == "router_logits" and self.metrics:
            self._train[key][tap.layer] = tensor
        self.inner.pair(key, tap, tensor)

    def add_sequences(self, sequences) -> None:
        """The sequences of an inference batch (compare.ScoredSequence): which prompt and sample each key is."""
        for seq in sequences:
            self._sequences[seq.key] = _Sequence(seq.prompt_id, seq.sample_id)
        if hasattr(self.inner, "add_sequences"):
            self.inner.add_sequences(sequences)

    def finish_prompt(self, key: int) -> None:
        infer, train, routes = self._infer.pop(key, {}), self._train.pop(key, {}), self._routes.pop(key, {})
        if self.metrics and (len(infer) != self.num_layers or len(train) != self.num_layers):
            raise StackError(f"sequence {key}: router logits of {len(infer)} (inference) and {len(train)} "
                             f"(training) of {self.num_layers} layers were captured; report this as a bug")
        self._check(key, infer, train, routes if self.records else {})
        if self.metrics:
            # finiteness was checked above, with the routes, in one read-back (not one per layer and side)
            per_layer = [routing.compare_layer(infer[i], train[i], self.top_k, check_finite=False)
                         for i in range(self.num_layers)]
            for i, r in enumerate(per_layer):
                self._layers[i].append(r)
            self._flips[key] = routing.token_flips(per_layer)
        self.inner.finish_prompt(key)

    def _check(self, key: int, infer: dict[int, torch.Tensor], train: dict[int, torch.Tensor], routes) -> None:
        """Both sides' router logits finite, and every layer's engine routes a top-k of its router logits; all of it
        read back from the device at once. Non-finite logits first: they are an overflow, not a bad record."""
        logits = [(side, layer, x) for side, taps in (("inference", infer), ("training", train))
                  for layer, x in sorted(taps.items())]
        admissible = []
        if routes and infer:
            for layer in range(self.num_layers):
                ids, router = routes.get(("expert_ids", layer)), infer.get(layer)
                if ids is None or router is None:
                    raise StackError(f"sequence {key}, layer {layer}: the engine handed over "
                                     f"{'no routes' if ids is None else 'no router logits'}; report this as a bug")
                if ids.shape[0] != router.shape[0]:
                    raise RouteRecordError(f"the engine routed {ids.shape[0]} rows of sequence {key} in layer {layer} "
                                           f"but computed router logits for {router.shape[0]}: its router ran on other "
                                           "rows than its gate (chunked MoE?); routing cannot be compared")
                admissible.append(routing.is_admissible_topk(router, ids, check_finite=False))
        if not logits:
            return
        finite = torch.stack([torch.isfinite(x).all() for _, _, x in logits])
        ok = torch.stack(admissible) if admissible else None
        flags = torch.cat([finite, ok.all(dim=1)]) if ok is not None else finite
        if all(flags.tolist()):
            self.records_checked += int(ok.numel()) if ok is not None else 0
            return
        bad = next((where for where, good in zip(logits, finite.tolist()) if not good), None)
        if bad is not None:
            raise NumericsError(f"the {bad[0]} stack's router logits of layer {bad[1]} hold NaN/Inf (sequence {key}); "
                                "the weights overflow in this dtype (try --dtype float32) or the checkpoint is broken")
        layer, token = (int(i) for i in (~ok).nonzero()[0])
        ids = routes[("expert_ids", layer)]
        raise RouteRecordError(
            f"the engine sent token {token} of sequence {key} in layer {layer} to experts "
            f"{sorted(ids[token].tolist())}, which are not a top-{ids.shape[1]} of its own router logits: "
            "the routes vLLM records (enable_return_routed_experts) are not what its router computed")

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
        """The run's routing comparison, on the host; None when router logits were not compared."""
        if not self.metrics or not self._flips:
            return None
        layers = [cat_routing(per_sequence) for per_sequence in self._layers]
        flips = {key: (f.cpu(), first.cpu()) for key, (f, first) in self._flips.items()}
        return RunRouting(layers, flips, dict(self._sequences), self.top_k, self.records_checked)


def cat_routing(parts: list[routing.LayerRouting]) -> routing.LayerRouting:
    """One layer's comparisons of several sequences as one, on the host."""
    return routing.LayerRouting(*(torch.cat([getattr(p, f) for p in parts]).cpu()
                                  for f in ("set_differs", "order_differs", "jaccard", "margin", "near_tie")))


def routing_table(layers: list[routing.LayerRouting]) -> pd.DataFrame:
    """routing.csv's rows (also local_routing.csv's, local.py): one per MoE layer, routing.layer_metrics."""
    rows = [{"layer": i, **routing.layer_metrics(r)} for i, r in enumerate(layers)]
    return pd.DataFrame(rows, columns=ROUTING_COLUMNS)


@dataclass
class RunRouting:
    """Both stacks' routing over a run: per layer (every routed row of every sequence, in run order) and per token."""

    layers: list[routing.LayerRouting]
    flips: dict[int, tuple[torch.Tensor, torch.Tensor]]  # sequence key -> (routing_flips, first_flip_layer) per row
    sequences: dict[int, _Sequence]
    top_k: int
    records_checked: int

    def table(self) -> pd.DataFrame:
        """routing.csv: one row per MoE layer (routing.layer_metrics)."""
        return routing_table(self.layers)

    def token_columns(self, tokens: pd.DataFrame) -> pd.DataFrame:
        """tokens.csv with routing_flips and first_flip_layer (at the token's own position: how many layers, and the
        first, where the two stacks sent this token to different experts; empty where the engine never ran the
        token, a sampled sequence's last) and upstream_flip (a flip at any earlier position of its sequence, in any
        layer: in the causal cone of the logits that scored this token)."""
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
        anywhere upstream in their sequence ("upstream_flip")."""
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
        return {"top_k": self.top_k,
                "tie_rule": "two sides' top-k differ only if no tie-break on either side makes them equal (routing.py)",
                "near_tie_ulps": routing.NEAR_TIE_ULPS,
                "engine_routes_checked_token_layers": self.records_checked}
