"""The report's section on --reference: which side is further from exact where the mismatch starts (the verdict of
numerics/reference.py, in its words), how each side's error grows over the layers, and in an ablation each
combination's error against the reference. Nothing when the run had no reference."""

from __future__ import annotations

import pandas as pd

from ..numerics.reference import GROWTH_LINEAR, SIDES, combination_lines, in_words
from ..numerics.shapley import SHIPPED
from .document import Bullets, Heading, Paragraph
from .run_data import RunData, layers_of, row_of

# summary.csv's reference columns, for the report's summary table (docs/reference/outputs.md says the same)
MEANINGS = {
    "reference": "precision of the reference forward (--reference)",
    "ref_at": "where the verdict is read: the tap where the mismatch starts, or logprobs when no tap diverged",
    "ref_err_infer": "inference stack's error against the reference at ref_at",
    "ref_err_train": "training stack's error against the reference at ref_at",
    "ref_floor": "the reference rounded once to the run's dtype: its error against the reference at ref_at",
    "ref_further": "the side further from the reference at ref_at (infer, train or tie)",
    "ref_ratio": "training error / inference error at ref_at",
    "ref_within_k": "whether the worse side's error is at most ref_k times the better one's plus the floor",
    "ref_verdict": "which side is further from exact, from the ratio's interval over prompts",
    "ref_logprob_err_infer": "mean |logprob_infer - logprob_ref| over scored tokens",
    "ref_logprob_err_train": "mean |logprob_train - logprob_ref| over scored tokens",
}


def reference_section(run: RunData) -> list:
    summary = run.summary
    if "reference" not in summary:
        return []
    shipped = row_of(summary, SHIPPED)
    words = in_words(shipped.to_dict())
    if words is None:
        return []
    blocks: list = [Heading("Which side is further from exact"), Paragraph(words)]
    growth = _layer_growth(layers_of(run, SHIPPED if run.is_ablate else None))
    if growth:
        blocks.append(Paragraph(growth))
    if run.is_ablate:
        lines = combination_lines(run.ablation, run.tokens, SHIPPED, int(run.manifest.get('ablate', {}).get('seed', 0)))
        if lines:
            blocks += [Paragraph(lines[0]), Bullets(tuple(line.strip() for line in lines[1:]))]
    return blocks


def _layer_growth(layers: pd.DataFrame) -> str | None:
    """The taps whose error against the reference grows like n over the layers, on each side (layers.csv's
    ref_growth_kind columns)."""
    if "ref_growth_kind_train" not in layers or not layers["ref_growth_kind_train"].map(
            lambda kind: isinstance(kind, str) and kind != "").any():  # no tap grows over layers (or none captured)
        return None
    parts = []
    for side, stack in zip(SIDES, ("inference", "training")):
        kinds = layers.drop_duplicates("tap").set_index("tap")[f"ref_growth_kind_{side}"]
        linear = sorted(tap for tap, kind in kinds.items() if kind == GROWTH_LINEAR)
        parts.append(f"on the {stack} side {', '.join(linear) if linear else 'none'}")
    return ("Over the layers, the taps whose error against the reference grows like n (a systematic bias, not "
            f"rounding noise, which grows like sqrt(n)): {'; '.join(parts)} (layers.csv, ref_growth_kind_*).")
