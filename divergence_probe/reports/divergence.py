"""The report's first divergence: the first tap, in data-flow order, whose values differ between the stacks, the
first over the threshold, and how the decoder layers' output error grows."""

from __future__ import annotations

from ..numerics.shapley import SHIPPED
from .document import Heading, Paragraph
from .run_data import RunData, layers_of, row_of
from .wording import _code, _get, _num


def _where(label: str, num_layers: int | None) -> str:
    """Plain words for `tap@layer`."""
    tap, _, layer = label.partition("@")
    try:
        k = int(layer)
    except ValueError:
        return _code(label)
    if k < 0:
        place = "the embedding"
    elif num_layers is not None and k >= num_layers:
        place = "after the last decoder layer"
    else:
        place = f"decoder layer {k}"
    return f"{_code(label)} (tap `{tap}` at {place})"



def first_divergence_section(run: RunData) -> list:
    shipped = row_of(run.summary, SHIPPED)
    combo = SHIPPED if run.is_ablate else None
    layers = layers_of(run, combo)
    n_layers = run.num_layers
    threshold = _get(run.manifest, "compare", "threshold")
    if run.is_score:
        return []
    blocks: list = [Heading("First divergence")]
    first, over = str(shipped.get("first_inexact", "not captured")), str(shipped.get("first_over_threshold", ""))
    scope = " (stacks as shipped)" if run.is_ablate else ""
    if first == "not captured":
        blocks.append(Paragraph("No taps were captured in this run (`--taps none`), so only the "
                                "token-level numbers are available."))
        return blocks
    if first == "none":
        blocks.append(Paragraph(f"Every captured tap is bitwise equal in the two stacks{scope}: no divergence."))
        return blocks
    text = f"The first tap, in the order data flows through the model, whose values are not bitwise equal{scope} is {_where(first, n_layers)}"
    tap, _, layer = first.partition("@")
    row = layers[(layers["tap"] == tap) & (layers["layer"].astype(str) == layer)]
    if len(row):
        r = row.iloc[0]
        details = []
        if "frac_equal" in r:
            details.append(f"{_num(100 * float(r['frac_equal']))}% of its elements still equal")
        if "max_ulp" in r:
            details.append(f"largest distance {_num(r['max_ulp'])} ULP")
        details.append(f"rel_l2 {_num(r['rel_l2'])}")
        text += ": " + ", ".join(details)
    text += "."
    if over and over != first:
        text += (f" The first tap whose relative L2 error exceeds the threshold {threshold} is "
                 + (_where(over, n_layers) if over not in ("none", "not captured") else "none") + ".")
    elif over == first:
        text += f" It is also the first tap whose relative L2 error exceeds the threshold {threshold}."
    resid = layers[layers["tap"] == "resid_out"]
    if len(resid) and resid["rel_l2"].notna().any():
        worst = resid.loc[resid["rel_l2"].idxmax()]
        last = resid.loc[resid["layer"].idxmax()]
        first_row = resid.loc[resid["layer"].idxmin()]
        text += (f" The decoder-layer output (`resid_out`) goes from rel_l2 {_num(first_row['rel_l2'])} after "
                 f"layer {int(first_row['layer'])} to {_num(last['rel_l2'])} after layer {int(last['layer'])}")
        text += (f", largest at layer {int(worst['layer'])} ({_num(worst['rel_l2'])})."
                 if int(worst["layer"]) != int(last["layer"]) else ".")
    blocks.append(Paragraph(text))
    if run.is_ablate:
        blocks.append(Paragraph("The ablation table below gives the first divergence of every combination."))
    return blocks
