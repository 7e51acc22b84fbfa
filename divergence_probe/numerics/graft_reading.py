"""What a user reads off compare --graft and --depth: which op family makes the largest error of its own
(local_families.csv, sorted by local error) and which step of the forward adds most of the gap (depth.csv), in
words the CLI and the report both print, so the answer is stated rather than left to be read off a table.

The op family each seam is filed under, and the taps a seam's op reads and writes, are here too: the graft
(runs/graft.py) and the reference arm's local reading (runs/reference.py) both measure seams by them, and neither
needs the other's capture for it.

depth.csv's point x is the gap the forward makes from x on when everything before x is the engine's, so what the
step at x adds is the drop to the next point: decoder layer x for x < L, the final norm at x = L, and the lm_head
alone at x = L + 1 (the last point, nothing after it). The steps add up to the whole gap, point 0.
"""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd

from ..taps import ALL_TAPS

# The op families a seam's local error is filed under, in the order tables and figures list them.
FAMILIES = ("gemm", "attention", "norm", "rope", "swiglu", "residual_add", "logits", "router", "experts")
# seam (the tap its op produces) -> op family. The seam's inputs are the taps its op reads (engines/hf/replay.py).
SEAM_FAMILY = {
    "input_norm": "norm", "q_proj": "gemm", "k_proj": "gemm", "v_proj": "gemm", "q_norm": "norm", "k_norm": "norm",
    "q_rope": "rope", "k_rope": "rope", "attn_core": "attention", "attn_out": "gemm", "resid_mid": "residual_add",
    "post_norm": "norm", "gate_proj": "gemm", "up_proj": "gemm", "swiglu": "swiglu", "mlp_out": "gemm",
    "resid_out": "residual_add", "final_norm": "norm", "logits": "logits",
}
# a mixture-of-experts layer's (runs/graft.py's docstring): the router's GEMM, and the experts on the engine's routes
MOE_SEAM_FAMILY = {"router_logits": "router", "mlp_out": "experts"}
GRAFT_TAPS = frozenset(ALL_TAPS)  # what a graft captures, a seam's inputs and outputs: every tap


def seam_families(layer_taps: Sequence[str]) -> dict[str, str]:
    """seam -> op family for a model family's layer taps (models/): a router among them makes it mixture-of-experts."""
    return {**SEAM_FAMILY, **(MOE_SEAM_FAMILY if "router_logits" in layer_taps else {})}


def step_name(x: int, num_layers: int) -> str:
    return f"decoder layer {x}" if x < num_layers else "the final norm" if x == num_layers else "the lm_head"


def depth_steps(depth: pd.DataFrame, num_layers: int, column: str = "mean_abs_dlogp") -> pd.DataFrame:
    """One row per step of the forward: what it adds to `column`'s gap and that as a share of the whole gap."""
    gap = depth.sort_values("layer")[["layer", column]].dropna()
    values = gap[column].to_numpy(float)
    adds = [values[i] - (values[i + 1] if i + 1 < len(values) else 0.0) for i in range(len(values))]
    total = values[0] if len(values) else float("nan")
    return pd.DataFrame({"step": [step_name(int(x), num_layers) for x in gap["layer"]], "adds": adds,
                         "share_of_gap": [a / total if total else float("nan") for a in adds]})


def families_by_local(families: pd.DataFrame) -> pd.DataFrame:
    """local_families.csv sorted by local error, largest first (the family that makes most of its own first)."""
    return families.sort_values("local_rel_l2", ascending=False, kind="stable")


def amplification_text(row) -> str:
    """propagated / local rel_l2 as shown: its value, or what a local error of 0 means (no ratio: the family hands on
    an error it does not make, or makes none and receives none)."""
    local, propagated, amplification = (float(row[c]) for c in ("local_rel_l2", "propagated_rel_l2", "amplification"))
    if local == 0:
        return "no own error: passes on what it receives" if propagated > 0 else "no error"
    return "n/a" if math.isnan(amplification) else f"{amplification:.3g}"


def findings(tables: dict[str, pd.DataFrame], num_layers: int | None) -> list[str]:
    """Sentences: the family with the largest local error, and the step that adds most of the gap."""
    lines = []
    families = tables.get("local_families")
    if families is not None and len(families):
        top = families_by_local(families).iloc[0]
        if float(top["local_rel_l2"]) > 0:
            lines.append(f"Largest error of its own: op family {top['family']} (local rel_l2 "
                         f"{float(top['local_rel_l2']):.3g}, its ops run on the engine's own inputs).")
        else:
            lines.append("No op family makes an error of its own: every op is bitwise equal on the engine's inputs.")
    depth = tables.get("depth")
    if depth is not None and num_layers is not None and len(depth):
        steps = depth_steps(depth, num_layers)
        if len(steps) and steps["adds"].max() > 0:
            top = steps.loc[steps["adds"].idxmax()]
            lines.append(f"Adds most of the gap: {top['step']}, {100 * top['share_of_gap']:.3g}% of the mean "
                         f"|Δlogprob| (depth.csv; {top['adds']:.3g} of {float(depth.sort_values('layer')['mean_abs_dlogp'].iloc[0]):.3g} nats).")
    return lines
