"""Grafted comparison: each op's local error (training op on the inference stack's inputs) and the depth curve.

A tap's diff in layers.csv is the *propagated* error: what an op's output differs by after everything upstream
differed too. `compare --graft` also measures the *local* error of every op: the training stack's own op (its
module or function, region patches included: engines/hf/replay.py) runs on the inference stack's captured input
of that op, and its output is diffed against the inference stack's output of the same op. Identical inputs, so
what remains is the op's own rounding. No second forward per seam: the inference taps of a sequence are parked
for pairing anyway (capture.TapPairing), and each seam costs one extra op on them, run when the sequence is done.

`--depth` continues the training forward from the inference stack's residual stream entering layer l (l = 0..L;
l = L enters the final norm) and from its final-norm output (the lm_head alone), and scores those logits against
the inference logits: how much of the logprob gap and KL the layers from l on make. That costs a partial forward
per l (about L/2 full forwards per sequence), so it is a flag of its own.

A mixture-of-experts layer (Qwen3-MoE) has two seams after `post_norm`, kept apart so that a local error is never a
routing difference. `router_logits` (family `router`) is the router's GEMM on the engine's `post_norm`. `mlp_out`
(family `experts`) is the trainer's MoE block run on the engine's `post_norm` *with the engine's routes*: its expert
ids and its gate weights (cast to the trainer's router output dtype, which the trainer's experts take), i.e. every
input the engine's experts read. Replayed with the trainer's own router instead, a token whose top-k the two routers
break differently would run other experts, and its "local error" would be a routing flip, not the experts'
arithmetic. The weights are the engine's for the same reason: the stacks compute them differently (vLLM a softmax
over the k chosen BF16 logits, transformers an FP32 softmax over every expert, renormalised), which is the
router's rounding, not the experts'. How often the routers themselves disagree on identical input is measured
apart: the trainer's top-k of its replayed `router_logits` against the engine's top-k of its own, with routing.csv's
tie rule, per layer (local_routing.csv, routing.csv's columns: a *local* flip rate beside routing.csv's propagated
one). Depth on MoE continues the trainer's forward with its own router from the graft point on.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from ..numerics import routing
from .capture import TapPairing
from ..errors import ProbeError
from ..numerics.graft_reading import FAMILIES, SEAM_FAMILY, seam_families
from ..numerics.metrics import DiffStats, token_kl, token_logprobs
from ..numerics.tables import HEADLINE, headline
from .route_capture import cat_routing, routing_table
from ..taps import Tap, TapKey, each_tap, expected_taps

# which seams an aligned region computes (regions/): their local error is the aligned op's
REGION_SEAMS = {"rope": ("q_rope", "k_rope"), "swiglu": ("swiglu",),
                "rmsnorm": ("input_norm", "post_norm", "final_norm", "q_norm", "k_norm"), "lm_head": ("logits",),
                "residual": ("input_norm", "resid_mid", "post_norm", "resid_out", "final_norm")}
STAT_COLUMNS = ("rel_l2", "mean_abs", "max_abs", "frac_equal", "max_ulp")
LOCAL_COLUMNS = ["layer", "tap", "family", "aligned", *(f"local_{c}" for c in STAT_COLUMNS),
                 *(f"propagated_{c}" for c in STAT_COLUMNS), "amplification"]
FAMILY_COLUMNS = ["family", "seams", "local_rel_l2", "local_frac_equal", "local_max_ulp", "propagated_rel_l2",
                  "amplification"]
DEPTH_COLUMNS = ["layer", "graft", *HEADLINE, "n_tokens"]


def seam_inputs(key: TapKey, num_layers: int, layer_taps: Sequence[str]) -> tuple[TapKey, ...]:
    """The inference taps a seam's replay reads (engines/hf/replay.py): its local error depends on these alone.
    A norm after a residual add is replayed with the add (the inference stack fuses them), from the residual
    entering the previous half-layer and the outputs added to it. An MoE block's output reads the engine's routes
    (taps.ROUTE_RECORDS) beside its input. `layer_taps`: the family's (models/)."""
    name, i = key.name, key.layer
    tap = TapKey.of
    has_qk_norm = "q_norm" in layer_taps
    moe = "router_logits" in layer_taps

    def resid_in(layer: int) -> TapKey:
        return tap("embed", -1) if layer == 0 else tap("resid_out", layer - 1)

    def block_end(layer: int) -> tuple[TapKey, ...]:  # what layer `layer`'s two residual adds read
        return resid_in(layer), tap("attn_out", layer), tap("mlp_out", layer)

    table = {
        "input_norm": lambda: (tap("embed", -1),) if i == 0 else block_end(i - 1),
        "q_proj": lambda: (tap("input_norm", i),), "k_proj": lambda: (tap("input_norm", i),),
        "v_proj": lambda: (tap("input_norm", i),),
        "q_norm": lambda: (tap("q_proj", i),), "k_norm": lambda: (tap("k_proj", i),),
        "q_rope": lambda: (tap("q_norm" if has_qk_norm else "q_proj", i), tap("k_norm" if has_qk_norm else "k_proj", i)),
        "attn_core": lambda: (tap("q_rope", i), tap("k_rope", i), tap("v_proj", i)),
        "attn_out": lambda: (tap("attn_core", i),),
        "resid_mid": lambda: (resid_in(i), tap("attn_out", i)), "post_norm": lambda: (resid_in(i), tap("attn_out", i)),
        "gate_proj": lambda: (tap("post_norm", i),), "up_proj": lambda: (tap("post_norm", i),),
        "swiglu": lambda: (tap("gate_proj", i), tap("up_proj", i)),
        "router_logits": lambda: (tap("post_norm", i),),
        "mlp_out": lambda: (tap("post_norm", i), tap("expert_ids", i), tap("expert_weights", i)) if moe
        else (tap("swiglu", i),),
        "resid_out": lambda: block_end(i), "final_norm": lambda: block_end(num_layers - 1),
        "logits": lambda: (tap("final_norm", num_layers),),
    }
    table["k_rope"] = table["q_rope"]  # one RoPE call rotates both
    return table[name]()


def check_graftable(train) -> None:
    """The trainer plays the Grafter role (engines/protocol.py), as its Capabilities declare."""
    if not train.capabilities().grafts:
        raise ProbeError(f"--graft/--depth need a training stack that can replay its ops on captured inputs; "
                         f"{train.name} cannot: use --train hf")


class GraftCapture:
    """TapPairing's park/pair/finish_prompt (it wraps one, for the propagated error), plus, as each sequence is
    finished, the training stack's replay of every seam on that sequence's inference taps (the local error) and,
    with depth, the partial forwards. Holds one inference batch of taps, as TapPairing does. `top_k`: a
    mixture-of-experts model's, whose engine hands over its routes (park_route) and whose local routing is compared."""

    def __init__(self, pairing: TapPairing, train, num_layers: int, layer_taps: Sequence[str], depth: bool,
                 top_k: int | None = None) -> None:
        self.pairing, self.train, self.num_layers, self.depth, self.top_k = pairing, train, num_layers, depth, top_k
        self.families = seam_families(layer_taps)
        self.seams = expected_taps(frozenset(self.families), num_layers, layer_taps)
        self.local = TapPairing(self.seams)
        self._routing: list[list[routing.LayerRouting]] = [[] for _ in range(num_layers)] if top_k else []
        self._infer: dict[int, dict[TapKey, torch.Tensor]] = defaultdict(dict)
        self._sequences: dict[int, object] = {}
        # depth point -> per-token |Δlogp| and KL arrays, in sequence order (a mean as summary_row takes it)
        self._depth: dict[int, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)

    def park(self, key: int, tap: Tap, x: torch.Tensor) -> None:
        self.pairing.park(key, tap, x)
        self._infer[key].update(each_tap(tap, x))

    def park_route(self, key: int, tap: TapKey, x: torch.Tensor) -> None:
        """The engine's routes of a sequence (taps.ROUTE_RECORDS, from route_capture.RouteCapture): inputs of the
        experts seam, never diffed."""
        self._infer[key][tap] = x

    def pair(self, key: int, tap: TapKey, x: torch.Tensor) -> None:
        self.pairing.pair(key, tap, x)

    def add_sequences(self, sequences) -> None:
        """compare.score_both hands over each inference batch's sequences (token ids, inference logits and
        logprobs), which the depth curve scores against."""
        if self.depth:
            self._sequences.update({seq.key: seq for seq in sequences})

    def finish_prompt(self, key: int) -> None:
        self.pairing.finish_prompt(key)
        taps = self._infer.pop(key)
        replayed = self.train.replay(taps)
        for seam in self.seams:
            self.local.park(key, seam, taps[seam])
            self.local.pair(key, seam, replayed[seam])
        self.local.finish_prompt(key)
        for i, per_sequence in enumerate(self._routing):  # the trainer's router on the engine's post_norm
            router = TapKey.of("router_logits", i)
            per_sequence.append(routing.compare_layer(taps[router], replayed[router], self.top_k))
        if self.depth:
            self._depth_points(taps, self._sequences.pop(key))

    def _depth_points(self, taps: Mapping[TapKey, torch.Tensor], seq) -> None:
        embed = taps[TapKey.of("embed", -1)]
        # scored rows: a prompt's all but the last; a sampled sequence's every fed row (the engine never feeds its
        # last sample back, so its taps have one row fewer than the sequence, and each of those rows is scored)
        n = min(seq.fed, seq.logits.shape[0])
        targets = torch.tensor(seq.prompt.token_ids[1:n + 1], device=embed.device)
        infer_logits = seq.logits[:n]
        infer_lp = seq.logprobs[:n].double().cpu()
        L = self.num_layers
        for point in range(L + 2):  # 0..L: the residual stream entering layer l; L+1: the final norm's output
            if point == L + 1:
                logits = self.train.lm_head(taps[TapKey.of("final_norm", L)])
            else:
                hidden = embed if point == 0 else taps[TapKey.of("resid_out", point - 1)]
                logits = self.train.forward_from(point, hidden, embed)
            logits = logits[:n]
            train_lp = token_logprobs(logits, targets).double().cpu()
            kl = token_kl(infer_logits, logits.to(infer_logits.device)).double().cpu()
            self._depth[point].append(((train_lp - infer_lp).abs().numpy(), kl.numpy()))

    # ------------------------------------------------------------------------------------------ tables
    def tables(self, aligned_regions=()) -> dict[str, pd.DataFrame]:
        tables = {"local.csv": local_frame(self.local.stats, self.pairing.stats, aligned_regions, self.families)}
        tables["local_families.csv"] = family_frame(self.local.stats, self.pairing.stats, self.families)
        if self._routing:
            tables["local_routing.csv"] = routing_table([cat_routing(parts) for parts in self._routing])
        if self.depth:
            tables["depth.csv"] = self.depth_frame()
        return tables

    def depth_frame(self) -> pd.DataFrame:
        L = self.num_layers
        rows = []
        for point in range(L + 2):
            parts = self._depth.get(point, [])
            dlogp = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0)
            kl = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0)
            graft = ("embed" if point == 0 else f"resid_out@{point - 1}") if point <= L else f"final_norm@{L}"
            rows.append({"layer": point, "graft": graft, **headline(dlogp, kl), "n_tokens": len(dlogp)})
        return pd.DataFrame(rows, columns=DEPTH_COLUMNS)


def _stat_values(stats: DiffStats | None) -> list[float]:
    if stats is None:
        return [float("nan")] * len(STAT_COLUMNS)
    row = stats.row()
    return [row[c] for c in STAT_COLUMNS]


def _amplification(propagated: float, local: float) -> float:
    """propagated / local rel_l2: how much larger the error an op hands on is than the one it makes."""
    if local > 0:
        return propagated / local
    return float("inf") if propagated > 0 else float("nan")


def local_frame(local: Mapping[TapKey, DiffStats], propagated: Mapping[TapKey, DiffStats],
                aligned_regions=(), families: Mapping[str, str] = SEAM_FAMILY) -> pd.DataFrame:
    """local.csv: per seam (tap, layer) the local and the propagated error, and their ratio. `families`: seam ->
    family (seam_families)."""
    aligned = {seam for region in aligned_regions for seam in REGION_SEAMS.get(region, ())}
    rows = []
    for key, stats in sorted(local.items()):
        loc, prop = _stat_values(stats), _stat_values(propagated.get(key))
        rows.append([key.layer, key.name, families[key.name], key.name in aligned, *loc, *prop,
                     _amplification(prop[0], loc[0])])
    return pd.DataFrame(rows, columns=LOCAL_COLUMNS)


def family_frame(local: Mapping[TapKey, DiffStats], propagated: Mapping[TapKey, DiffStats],
                 families: Mapping[str, str] = SEAM_FAMILY) -> pd.DataFrame:
    """local_families.csv: per op family, the local and propagated error pooled over its seams (every element of
    every seam of the family, so rel_l2 is sqrt(Σ diff² / Σ ref²) over all of them)."""
    rows = []
    for family in FAMILIES:
        keys = [k for k in sorted(local) if families[k.name] == family]
        if not keys:
            continue
        pooled_local = _pool(local[k] for k in keys)
        pooled_prop = _pool(propagated[k] for k in keys if k in propagated)
        loc, prop = pooled_local.row(), pooled_prop.row() if pooled_prop else None
        prop_rel = prop["rel_l2"] if prop else float("nan")
        rows.append([family, len(keys), loc["rel_l2"], loc["frac_equal"], loc["max_ulp"], prop_rel,
                     _amplification(prop_rel, loc["rel_l2"])])
    return pd.DataFrame(rows, columns=FAMILY_COLUMNS)


def _pool(stats) -> DiffStats | None:
    pooled = None
    for s in stats:
        pooled = s if pooled is None else pooled.merge(s)
    return pooled
