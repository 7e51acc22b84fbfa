"""The report's attribution of an ablation (attribution.csv): each region's Shapley change of the metric in words
with its interval, the table, and how to read it."""

from __future__ import annotations

import pandas as pd

from ..numerics.shapley import ALL_REGIONS, CHANGE, DISAGREE, SHARE, effect_words
from .document import Column, Paragraph, Table
from .run_data import RunData
from .wording import _get, _signed_pct, read_intervals, share_interval, too_few_prompts


def _attribution_table(run: RunData) -> Table:
    a = run.attribution
    cols = [("region", "code"), (CHANGE, "num"), (SHARE, "pct"), ("share_ci_low", "pct"), ("share_ci_high", "pct"),
            ("main_effect_change", "num"), ("leave_one_out_change", "num"), ("ci_low", "num"), ("ci_high", "num")]
    cols = [(c, k) for c, k in cols if c in a]
    rows = tuple(tuple(None if pd.isna(r[c]) else r[c] for c, _ in cols) for _, r in a.iterrows())
    return Table("attribution",
                 f"Change in `{run.metric}` when each region is aligned (attribution.csv): below 0 the region removes "
                 f"mismatch, above 0 it adds some; `{SHARE}` is that change in percent of the shipped value, "
                 f"share_ci_low/share_ci_high its {run.ci_level} bootstrap interval; ci_low/ci_high the interval of "
                 f"`{CHANGE}`. The last row, `{ALL_REGIONS}`, is every region aligned together.",
                 tuple(Column(c, k) for c, k in cols), rows)


def _attribution_words(run: RunData) -> Paragraph | None:
    """The attribution as sentences: what aligning everything does to the shipped metric, then each region, the one
    that removes most first, and which of them the bootstrap cannot tell from no effect."""
    a = run.attribution
    if a is None or SHARE not in a:
        return None
    m = run.metric
    a, few = read_intervals(run, a)  # an interval on too few prompts is not read (as the noise verdict's: as_read)
    total = a[a["region"] == ALL_REGIONS]
    regions = a[a["region"] != ALL_REGIONS].sort_values(SHARE, kind="stable")
    text = ""
    if few:
        text += too_few_prompts(run)
    if len(total):
        t = total.iloc[0]
        low, high = t.get("share_ci_low", float("nan")), t.get("share_ci_high", float("nan"))
        text += (f"Aligning every region together: **{effect_words(float(t[SHARE]), float(low), float(high), run.ci_level)}**"
                 f" of the shipped `{m}`{share_interval(low, high, run.ci_level)}.")
    parts = []
    for r in regions.itertuples(index=False):
        row = r._asdict()
        low, high = float(row.get("share_ci_low", float("nan"))), float(row.get("share_ci_high", float("nan")))
        parts.append(f"`{row['region']}` {effect_words(float(row[SHARE]), low, high, run.ci_level)}"
                     + share_interval(low, high, run.ci_level))
    if parts:
        text += " Of that, as Shapley values: " + "; ".join(parts) + "."
    for row in a.to_dict("records"):
        if row.get(DISAGREE) in (True, "True"):
            text += (f" Under `{row['other_metric']}` `{row['region']}` points the other way "
                     f"({_signed_pct(row[SHARE])} of shipped `{m}`, {_signed_pct(row['other_metric_share'])} of "
                     f"shipped `{row['other_metric']}`): whether it removes mismatch depends on the metric.")
    return Paragraph(text.strip())


def _attribution_reading(run: RunData) -> Paragraph:
    m = run.metric
    draws = _get(run.manifest, "ablate", "bootstrap", default="the")
    return Paragraph(
        f"**How to read the attribution.** Write m for `{m}` and v(S) = m(S) − m(`none`) for how much aligning "
        "the set of regions S changes it: below 0 aligning S removes mismatch, above 0 it adds some. A region's "
        f"`{CHANGE}` is its average marginal change over every order in which the regions could be aligned; the "
        f"regions' values add up exactly to v(all), the `{ALL_REGIONS}` row. `{SHARE}` divides each by the shipped "
        "m(`none`), so every row of that column is a share of the same quantity and keeps its sign whatever the "
        "total does: −25% means the region removes a quarter of the shipped mismatch, +90% that it adds nine "
        "tenths of it. `main_effect_change` is the change from aligning the region alone, `leave_one_out_change` "
        "the change from adding it last to the others: a large main effect with a small leave-one-out means its "
        "effect overlaps other regions', the reverse that it only matters together with them. "
        f"The intervals are {run.ci_level} percentile bootstrap intervals ({draws} resamples of prompts with "
        "replacement); an interval that contains 0 means the effect is not distinguishable from prompt-to-prompt "
        f"noise. What is left with every region aligned is m(`none`) + v(all): the GEMMs, attention kernels and "
        "everything outside the regions.")


def attribution_section(run: RunData) -> list:
    """An ablation's attribution in words, its table and how to read it; nothing for a run without one."""
    if run.attribution is None:
        return []
    words = _attribution_words(run)
    return [*([words] if words else []), _attribution_table(run), _attribution_reading(run)]
