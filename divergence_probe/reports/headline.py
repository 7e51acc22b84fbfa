"""The report's headline numbers: the shipped mismatch in nats, aligned against shipped in an ablation, the
importance ratio in generate mode and its three factors, and every noise floor measured with the mismatch set
against the largest."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..numerics.noise_verdict import VERDICT, WITHIN, as_read, floor_moved, in_words
from ..numerics.shapley import SHIPPED, change_words
from ..numerics.tables import HEADLINE, NOISE_FLOORS, largest_noise_floor, noise_floors
from .document import Heading, Paragraph
from .run_data import RunData, response_rho, row_of
from .wording import FACTORS, GENERATE_FACTORS, _num, scored_prompts


def _zero_run(row: pd.Series) -> bool:
    cols = [c for c in HEADLINE if c in row]
    return bool(cols) and all(float(row[c]) == 0.0 for c in cols)


def headline_section(run: RunData) -> list:
    shipped = row_of(run.summary, SHIPPED)
    blocks: list = [Heading("Headline numbers")]

    def sentence(row: pd.Series) -> str:
        parts = []
        if "mean_abs_dlogp" in row:
            who = "the recorded logprobs and the training stack's" if run.is_score else \
                "the logprobs the two stacks give the same token"
            parts.append(f"{who} differ by **{_num(row['mean_abs_dlogp'])}** "
                         f"nats on average (|Δlogprob|; 99th percentile {_num(row.get('p99_abs_dlogp'))}, "
                         f"max {_num(row.get('max_abs_dlogp'))})")
        if "mean_kl" in row and not (run.is_score and pd.isna(row["mean_kl"])):  # score: KL needs the prefill
            kl = ("KL(π_prefill ‖ π_train) over the full vocabulary, the engine's prefill against the trainer,"
                  if run.is_score else "KL(π_infer ‖ π_train) over the full vocabulary")
            parts.append(f"the mean per-token {kl} is **{_num(row['mean_kl'])}** nats (max {_num(row.get('max_kl'))})")
        return " and ".join(parts)

    n = shipped.get("n_tokens")
    what = "response tokens" if run.is_generate and "n_response_tokens" in shipped else "scored tokens"
    lead = f"Over {int(n)} {what}" if n is not None and not pd.isna(n) else f"Over the {what}"
    if run.is_generate and "n_sequences" in shipped and not pd.isna(shipped["n_sequences"]):
        lead += f" ({int(shipped['n_sequences'])} sampled responses)"
    if run.is_ablate:
        lead += f" with the stacks as shipped (combination `{SHIPPED}`)"
    blocks.append(Paragraph(f"{lead}, {sentence(shipped)}."))
    if "prompt_mean_abs_dlogp" in shipped:
        blocks.append(Paragraph(
            f"On the prompt tokens, scored in the same forward passes, the mean |Δlogprob| is "
            f"{_num(shipped['prompt_mean_abs_dlogp'])} nats and the mean KL {_num(shipped.get('prompt_mean_kl'))} nats."))
    if _zero_run(shipped):
        blocks.append(Paragraph("Every number is exactly 0: the two stacks agree bitwise on every scored token."))
    if run.is_ablate and run.all_aligned:
        full = row_of(run.ablation, run.all_aligned)
        m, before, after = run.metric, float(shipped[run.metric]), float(full[run.metric])
        change = f": aligning every region {change_words((after - before) / before)} of the shipped value" \
            if before else ""
        best = run.ablation.sort_values(m, kind="stable").iloc[0]
        blocks.append(Paragraph(
            f"With every region aligned (`{run.all_aligned}`), {sentence(full)}. The ablation metric `{m}` goes "
            f"from {_num(before)} to {_num(after)}{change}; the lowest `{m}` of all combinations is "
            f"{_num(best[m])}, with `{best['combo']}`." + (" " + moved if (moved := floor_moved(
                shipped, full, f"`{run.all_aligned}`")) else "")))
    rho = response_rho(run)
    if rho is not None and len(rho):
        eps = run.clip_eps
        outside = int(((rho < 1 - eps) | (rho > 1 + eps)).sum())
        blocks.append(Paragraph(
            f"On the {len(rho)} response tokens, the importance ratio ρ = exp(logprob_train − logprob_infer) "
            f"ranges from {_num(rho.min())} to {_num(rho.max())} (mean {_num(rho.mean())}; mean |ρ − 1| "
            f"{_num(np.abs(rho - 1).mean())}); {outside} tokens ({_num(100 * outside / len(rho))}%) fall "
            f"outside the clip band [{1 - eps:g}, {1 + eps:g}] (ε = {eps:g}) and would be clipped by a "
            + ("PPO-style objective." if run.is_score else
               "PPO-style objective purely because the stacks round differently.")))
    rl = [f"`{c}` {_num(shipped[c])}" for c in ("k3", "tis_truncated_frac", "mis_masked_frac", "ess",
                                                  "seq_max_abs_logratio", "ppl_ratio") if c in shipped]
    if rl:
        blocks.append(Paragraph("Other RL diagnostics from summary.csv (meanings in the summary table below): "
                                + ", ".join(rl) + "."))
    if "dominant_factor" in shipped and not run.is_score:  # a score run's split: "What the run saw"
        blocks.append(_ratio_split(shipped))
    if not run.is_score:  # a score run's baseline is the engine's prefill: "What the run saw"
        blocks += _noise_floor(as_read(shipped, scored_prompts(run)))
    blocks.append(Paragraph("Numbers in this report are rounded to 3 significant digits (scientific notation "
                            "below 1e-4); the run's CSV files hold full precision."))
    return blocks


def _ratio_split(shipped: pd.Series) -> Paragraph:
    """generate mode: π_train/π_recorded as three factors, which one is large, and the largest noise floor beside it
    (a factor no larger than what one stack does to itself under a batch, kernel or mode change is noise)."""
    parts = [f"{FACTORS[f]}: " + (f"mean |log| {_num(shipped[f + '_mean_abs_dlogp'])} nats (signed mean "
                                  f"{_num(shipped[f + '_mean_dlogp'])})" if shipped[f + "_mean_abs_dlogp"] else
                                  "exactly 1 on every token (bitwise equal logprobs)") for f in GENERATE_FACTORS]
    text = ("Per response token the importance ratio π_train/π_recorded is the product of three factors, whose logs "
            "add up to Δlogprob exactly: " + "; ".join(parts) + f"; and {FACTORS['decode_vs_recorded']}, 1 by "
            "construction: the decode path's logprobs are this run's recording.")
    dominant = str(shipped["dominant_factor"])
    if dominant not in GENERATE_FACTORS:
        return Paragraph(text + " Every factor is exactly 1: prefill, decode and trainer agree bitwise.")
    text += f" The largest is {FACTORS[dominant]}"
    text += {"train_vs_prefill": ": most of the gap is the two stacks' numerics, not the decode path.",
             "prefill_vs_decode": ": the engine's decode-time logprobs are farther from its own prefill than the "
                                  "prefill is from the trainer, so aligning the stacks' rounding alone will not close "
                                  "the gap.",
}[dominant]
    floors = noise_floors(shipped)
    engine = {name: v for name, v in floors.items() if name.startswith("noise_infer_")}
    # the stacks' gap beside every floor measured; the engine's prefill/decode gap beside the engine's own floors
    for factor, measured in (("train_vs_prefill", floors), ("prefill_vs_decode", engine)):
        if measured and shipped[factor + "_mean_abs_dlogp"]:
            name, floor = max(measured.items(), key=lambda item: item[1])
            value = float(shipped[factor + "_mean_abs_dlogp"])
            text += (f" Factor `{factor}` beside the largest {'engine ' if measured is engine else ''}noise floor "
                     f"({NOISE_FLOORS[name]}, {_num(floor)} nats): "
                     + (f"{_num(value / floor)}×." if floor > 0 else "that floor is 0."))
    return Paragraph(text)


# floors measured on one stack, as the report words them: column -> (the change, the file it is in)
SINGLE_FLOORS = {
    "noise_train_kernel_mean_abs_dlogp": ("running the training stack's attention on another SDPA kernel moves its "
                                          "logprobs by", "kernel_noise.csv"),
    "noise_infer_engine_mode_mean_abs_dlogp": ("the engine in its other mode (eager vs compiled) moves its logprobs by",
                                               "engine_noise.csv"),
    "noise_infer_tensor_parallel_mean_abs_dlogp": ("the engine at tensor_parallel_size 1 instead of this run's moves "
                                                   "its logprobs by", "engine_noise.csv"),
    "noise_train_tensor_parallel_mean_abs_dlogp": ("the training stack unsharded instead of this run's --train-tp "
                                                   "moves its logprobs by", "kernel_noise.csv"),
}


def _noise_floor(shipped) -> list:
    """Each noise floor measured (a stack against itself under a batch, kernel or engine-mode change), and the
    vLLM-vs-transformers mismatch set against the largest of them: one kernel change can move logprobs as much as
    the whole gap, so the mismatch alone says little."""
    floors = noise_floors(shipped)
    if not floors:
        return [Paragraph("No noise floor was measured for this run: a stack's own batch, kernel or engine-mode change "
                          "can move its logprobs as much as the mismatch itself, so read the numbers above against a "
                          "run with `--batch-invariance` (and `--engine-noise` for the engine's mode).")]
    parts = []
    if "noise_infer_mean_abs_dlogp" in floors and "noise_train_mean_abs_dlogp" in floors:
        parts.append("scoring the same sequences one at a time and then in one batch changes the inference stack's "
                     f"logprobs by {_num(floors['noise_infer_mean_abs_dlogp'])} nats on average and the training "
                     f"stack's by {_num(floors['noise_train_mean_abs_dlogp'])} nats (batch_invariance.csv)")
    for column, (before, after) in SINGLE_FLOORS.items():
        if column in floors:
            parts.append(f"{before} {_num(floors[column])} nats ({after})")
    text = "Noise floor: " + "; ".join(parts) + "."
    tap_points = shipped.get("tap_points_mean_abs_dlogp")
    if tap_points is not None and not pd.isna(tap_points):
        text += (" The engine's tap points left its logprobs bitwise unchanged." if float(tap_points) == 0 else
                 f" The engine's tap points moved its logprobs by {_num(tap_points)} nats: its taps are not what an "
                 "untapped engine computes.")
    mismatch = float(shipped.get("mean_abs_dlogp", float("nan")))
    name, largest = largest_noise_floor(shipped)
    verdict = shipped.get(VERDICT)
    if isinstance(verdict, str):  # the ratio's bootstrap interval over prompts decides, not the point ratio
        text += (f" The mismatch between the stacks, {_num(mismatch)} nats, set against the largest of these floors "
                 f"({NOISE_FLOORS[name]}): **{in_words(shipped)}**" + (
                     ": no larger than what that change alone does, so it is no evidence of a numerics bug in "
                     "either stack." if verdict == WITHIN else "."))
    elif largest > 0 and not math.isnan(mismatch):  # a run folder from before the verdict was recorded
        text += (f" The mismatch between the stacks, {_num(mismatch)} nats, is {_num(mismatch / largest)}× the "
                 f"largest of these floors ({NOISE_FLOORS[name]}); this run recorded no interval for that ratio.")
    return [Paragraph(text)]

