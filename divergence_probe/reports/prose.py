"""The report's text: setup, headline numbers, first divergence, tables and how to read them, as blocks."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ..numerics.shapley import ALL_REGIONS, CHANGE, DISAGREE, SHARE, SHIPPED, change_words, effect_words
from ..numerics.noise_verdict import VERDICT, WITHIN, as_read, floor_moved, in_words
from ..numerics.tables import HEADLINE, NOISE_FLOORS, NOT_CAPTURED, largest_noise_floor, noise_floors
from .document import Bullets, Column, Figure, Heading, Paragraph, Table
from ..numerics.graft_reading import amplification_text, families_by_local, findings
from .run_data import RunData, layers_of, response_rho, row_of, shipped_rows
from .moe import routing_section
from .reference import MEANINGS as REFERENCE_MEANINGS, reference_section
from .remedies import remedies_section
from .recorded import MEANINGS, recorded_section, setup_items
from .wording import FACTORS, GENERATE_FACTORS, _code, _finite, _get, _num, _signed_pct, read_intervals, scored_prompts, \
    share_interval, too_few_prompts

# Column meanings as docs/reference/outputs.md ("Output files") and docs/reference/generate-mode.md ("Reading the RL
# metrics", "The noise floor") document them.
# In generate mode r = logprob_train − logprob_infer of a sampled response token and ρ = exp(r).
SUMMARY_MEANINGS = {
    "mean_abs_dlogp": "mean |Δlogprob| over scored tokens (nats)",
    "max_abs_dlogp": "largest |Δlogprob| (nats)",
    "p99_abs_dlogp": "99th percentile of |Δlogprob| (nats)",
    "std_abs_dlogp": "standard deviation of |Δlogprob| (nats)",
    "mean_kl": "mean per-token KL(π_infer ‖ π_train) over the full vocabulary (nats)",
    "max_kl": "largest per-token KL (nats)",
    "first_inexact": "first tap, in forward order, that is not bitwise equal (`tap@layer`)",
    "first_over_threshold": "first tap whose rel_l2 exceeds the threshold",
    "n_tokens": "scored tokens",
    "prompt_mean_abs_dlogp": "mean |Δlogprob| over the prompt tokens (nats)",
    "prompt_mean_kl": "mean full-vocabulary KL over the prompt tokens (nats)",
    "mean_abs_dp": "mean |π_train − π_infer| of the sampled token (probability)",
    "max_abs_dp": "largest |π_train − π_infer| of the sampled token (probability)",
    "k1": "mean of −r: k1 estimator of KL(π_infer ‖ π_train) from samples (nats)",
    "k2": "mean of r²/2: k2 estimator of the KL (nats)",
    "k3": "mean of (ρ − 1) − r: k3 estimator of the KL, ≥ 0 (nats)",
    "ratio_mean": "mean importance ratio ρ",
    "ratio_std": "standard deviation of ρ",
    "ratio_min": "smallest ρ",
    "ratio_max": "largest ρ",
    "ppo_clip_frac": "fraction of response tokens with ρ outside [1−ε, 1+ε]: PPO clipping from numerics alone",
    "tis_truncated_frac": "fraction with ρ above the TIS cap C (truncated importance sampling)",
    "mis_masked_frac": "fraction with ρ outside [1/C, C] (masked importance sampling)",
    "ess": "effective sample size fraction (Σρ)²/(n Σρ²), in (0, 1]",
    "n_response_tokens": "response tokens",
    "seq_mean_abs_logratio": "mean over responses of |Σ r| (nats)",
    "seq_max_abs_logratio": "largest |Σ r| over responses (nats)",
    "mean_logppl_diff": "mean over responses of log PPL_train − log PPL_infer",
    "ppl_ratio": "exp(mean_logppl_diff): PPL_train / PPL_infer",
    "seq_geo_ratio_outside_frac": "fraction of responses whose geometric-mean ratio is outside [1−ε, 1+ε]",
    "n_sequences": "responses",
    "noise_infer_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the inference stack, one sequence per call vs one batch",
    "noise_train_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the training stack, one sequence per call vs one batch",
    "noise_train_kernel_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the training stack under another SDPA "
                                         "attention kernel",
    "noise_infer_engine_mode_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the engine in its other mode (eager vs "
                                              "compiled)",
    "noise_infer_tensor_parallel_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the engine at tensor_parallel_size 1 "
                                                  "vs this run's",
    "noise_train_tensor_parallel_mean_abs_dlogp": "noise floor: mean |Δlogprob| of the training stack unsharded vs "
                                                  "this run's --train-tp",
    "frac_tokens_any_flip": "routed positions the two stacks ran through different experts (the ids each router "
                            "returned) in at least one MoE layer",
    "frac_tokens_after_flip": "scored tokens whose logits came from a position that flipped in some layer",
    "mean_abs_dlogp_after_flip": "mean |Δlogprob| of the tokens right after a flip (nats)",
    "mean_abs_dlogp_not_after_flip": "mean |Δlogprob| of the other tokens (nats)",
    "frac_tokens_upstream_flip": "scored tokens with a flip at any earlier position of their sequence",
    "mean_abs_dlogp_upstream_flip": "mean |Δlogprob| of the tokens with an upstream flip (nats)",
    "mean_abs_dlogp_no_upstream_flip": "mean |Δlogprob| of the tokens without one (nats)",
    "noise_infer_frac_experts_differ": "routing noise floor: the inference stack against itself, one sequence per "
                                       "call vs one batch: fraction of tokens it ran through other experts, mean over "
                                       "layers",
    "noise_train_frac_experts_differ": "routing noise floor: the same for the training stack",
    "noise_train_kernel_frac_experts_differ": "routing noise floor: the training stack against itself under another "
                                              "SDPA kernel: fraction of tokens it ran through other experts, mean over "
                                              "layers",
    "noise_infer_frac_topk_set_differs": "routing noise floor: the inference stack against itself, one sequence per "
                                         "call vs one batch: fraction of tokens whose router logits' top-k set "
                                         "differs under every tie-break, mean over layers",
    "noise_train_frac_topk_set_differs": "routing noise floor: the same for the training stack",
    "noise_infer_frac_tokens_any_flip": "routing noise floor: positions the inference stack runs through other "
                                        "experts against itself in at least one layer",
    "noise_train_frac_tokens_any_flip": "routing noise floor: the same for the training stack",
    "noise_train_kernel_frac_topk_set_differs": "routing noise floor: the training stack against itself under another "
                                                "SDPA kernel (kernel_noise.csv's change): fraction of tokens whose "
                                                "router logits' top-k set differs, mean over layers",
    "noise_train_kernel_frac_tokens_any_flip": "routing noise floor: positions that kernel change flips in at least "
                                               "one layer",
    "routing_largest_noise_floor": "the largest routing noise floor measured (its summary column)",
    "routing_noise_floor_kind": "that floor's kind: noise (a stack's batch change) or systematic (the trainer's "
                                "kernel change)",
    "frac_tokens_any_flip_over_largest_floor": "frac_tokens_any_flip over the largest routing noise floor",
    "tap_points_mean_abs_dlogp": "mean |Δlogprob| of the compiled engine with tap points vs one built without them "
                                 "(0: the tap points left its numerics alone)",
    "train_vs_prefill_mean_abs_dlogp": "mean |logprob_train − logprob_prefill|: the trainer vs the engine's prefill of "
                                       "the same sequence, the stacks' numerics (nats)",
    "train_vs_prefill_mean_dlogp": "mean of logprob_train − logprob_prefill (nats)",
    "prefill_vs_decode_mean_abs_dlogp": "mean |logprob_prefill − logprob_infer|: the engine's prefill vs its own decode "
                                        "path (nats)",
    "prefill_vs_decode_mean_dlogp": "mean of logprob_prefill − logprob_infer (nats)",
    "dominant_factor": "the factor of π_train/π_recorded with the largest mean |log factor|",
    "mismatch_over_floor": "mean_abs_dlogp / the largest floor measured (noise or systematic: noise_floor_kind)",
    "mismatch_over_floor_ci_low": "low end of the 95% bootstrap interval of that ratio (prompts resampled, the "
                                  "mismatch's and the floor's together; empty below the minimum number of prompts)",
    "mismatch_over_floor_ci_high": "high end of that interval",
    "noise_verdict": "above_floor (the whole interval above 1), within_floor (none of it above 1), cannot_tell "
                     "(it straddles 1: more prompts would narrow it) or too_few_prompts (no interval)",
    "noise_floor_used": "the floor the ratio and the verdict are against (its summary column)",
    "noise_floor_kind": "that floor's kind: noise (a stack's batch or run-to-run wobble) or systematic (a kernel, "
                        "mode or sharding swap)",
    "noise_verdict_prompts": "the prompts the ratio's interval resampled",
}
# The columns of buckets.csv the report shows (the CSV has every token metric per bucket).
BUCKET_COLUMNS = ("group", "bucket", "n_tokens", "mean_kl", "mean_abs_dlogp", "max_abs_dlogp", "k3", "ratio_min",
                  "ratio_max", "ppo_clip_frac")


def _versions(d: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted((d or {}).items())) or "unknown"


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


# The optional tables a run may carry, in the order the report shows them, with what each one means.
EXTRA_TABLES = {
    "batch_invariance": "Noise floor (batch_invariance.csv): each stack scores the same sequences one per call and "
                        "then all in one batch; the columns compare the two.",
    "kernel_noise": "Noise floor (kernel_noise.csv): the training stack scores the same sequences with another SDPA "
                    "attention kernel (and, at --train-tp N, unsharded: `train_tp 1 vs N`); the columns compare the "
                    "two.",
    "local_families": "Local error per op family (local_families.csv, from compare --graft): the training stack's op "
                      "on the inference stack's inputs of each seam (`local_*`) and the ordinary per-tap diff "
                      "(`propagated_*`), pooled over the family's seams, largest local error first; `amplification` = "
                      "propagated / local rel_l2 (where the local error is 0 there is no ratio: the family makes no "
                      "error of its own and passes on what it receives). local.csv has every seam and layer.",
    "depth": "Depth attribution (depth.csv, from compare --depth): the training forward continued from the inference "
             "stack's `graft` tensor, scored against the inference logits.",
    "engine_noise": "Noise floor (engine_noise.csv): a second vLLM engine in the other engine mode (eager vs compiled, "
                    "the same regions aligned) scores the same sequences, and a compiled engine with tap points is "
                    "also scored against one built without them; an engine at tensor_parallel_size N > 1 is scored "
                    "against the same engine at 1 instead; the columns compare each with this run's engine.",
}


# ---------------------------------------------------------------------------------------------- document
ENGINE_CONFIG = ("mode", "backend", "cudagraph_mode", "custom_ops")  # of the compiled engine's configuration
TRAINER_SETTINGS = ("train_sdpa", "train_state", "train_precision", "sdpa_kernel_chosen", "torch_numerics_snapshot")


def _settings(settings: dict) -> str:
    """A stack's settings on one line: plain values as they are; of the nested ones (the engine's compilation
    configuration, per-tap status, torch's numerics state) only what a reader compares runs by, the rest is in
    manifest.json."""
    parts, nested = [], []
    for key, value in sorted(settings.items()):
        if not isinstance(value, dict):
            parts.append(f"{key}={_code(value)}")
        elif key == "compilation":
            parts.append("compilation=" + _code({k: value[k] for k in ENGINE_CONFIG if k in value}))
        elif key in ("sdpa_kernel_chosen", "engine_args"):
            parts.append(f"{key}={_code(value)}")
        else:
            nested.append(f"`{key}`")
    return ", ".join(parts) + (f" ({', '.join(nested)} in manifest.json)" if nested else "")


def _setup(run: RunData) -> list:
    m = run.manifest
    model, load, env = m.get("model", {}), m.get("load", {}), m.get("environment", {})
    infer, train = _get(m, "stacks", "infer", default={}), _get(m, "stacks", "train", default={})
    items = [
        f"Model: {_code(model.get('spec', 'unknown'))} (architecture `{model.get('arch', 'unknown')}`, "
        f"{model.get('num_layers', 'unknown')} decoder layers"
        + (f", config.json sha256 `{str(model['config_sha256'])[:12]}…`" if model.get("config_sha256") else "") + ")",
        f"Precision and device: `{load.get('dtype', 'unknown')}` on `{load.get('device', 'unknown')}`"
        + (f" ({env['gpu']})" if env.get("gpu") else "") + (f"; CPU {env['cpu']}" if env.get("cpu") else ""),
        *(setup_items(run) if run.is_score else ()),
        *(() if run.is_score and not infer else
          (f"Inference stack: `{infer.get('name', load.get('infer', 'unknown'))}` "
           f"({_versions(infer.get('versions'))})",)),
        f"Training stack: `{train.get('name', load.get('train', 'unknown'))}` ({_versions(train.get('versions'))})"
        + (f", attention `{load['train_attn']}`" if load.get("train_attn") else ""),
    ]
    if infer.get("settings"):
        items.append("Inference settings: " + _settings(infer["settings"]))
    trainer = {k: v for k, v in train.get("settings", {}).items() if k in TRAINER_SETTINGS}
    if trainer:
        items.append("Training settings: " + _settings(trainer))
    prompts = f"{run.n_prompts} prompts" if run.n_prompts is not None else "unknown number of prompts"
    if run.n_truncated:
        prompts += f" ({run.n_truncated} truncated to {_get(m, 'compare', 'max_prompt_tokens')} tokens)"
    source = _get(m, "compare", "prompts")
    n_tokens = row_of(run.summary, SHIPPED).get("n_tokens")
    items.append(f"Prompts: {prompts}" + (f" from {_code(Path(str(source)).name)}" if source else "")
                 + (f", {int(n_tokens)} scored tokens" if n_tokens is not None and not pd.isna(n_tokens) else ""))
    taps = _get(m, "compare", "taps")
    items.append(f"Seed: `{load.get('seed', 'unknown')}`; no taps (score compares token logprobs only)" if run.is_score
                 else f"Seed: `{load.get('seed', 'unknown')}`; divergence threshold (rel_l2): "
                 f"`{_get(m, 'compare', 'threshold', default='unknown')}`; taps captured: "
                 + (f"{len(taps)}" if isinstance(taps, list) else "unknown"))
    if run.is_ablate:
        a = m.get("ablate", {})
        side = {"both": "both stacks", "train": "the training stack only (the engine as shipped)",
                "infer": "the inference stack only"}.get(a.get("side"), str(a.get("side", "unknown")))
        items.append(f"Ablation: regions {', '.join(_code(r) for r in run.regions)} aligned in every "
                     f"combination ({len(run.combos)} runs) on {side}; metric `{run.metric}`; "
                     f"{a.get('bootstrap', 'unknown')} bootstrap draws (seed `{a.get('seed', 'unknown')}`)")
    if "generate" in m:
        g = m["generate"]
        desc = ", ".join(f"{k}={_code(v)}" for k, v in sorted(g.items())) if isinstance(g, dict) else _code(g)
        items.append(f"Generation: {desc}; importance-ratio clip ε = {run.clip_eps:g}")
    if env.get("python") or env.get("platform"):
        items.append(f"Environment: Python {env.get('python', '?')} on {_code(env.get('platform', '?'))}")
    if m.get("command"):
        command = m["command"]
        items.append("Command: " + _code(" ".join(map(str, command)) if isinstance(command, list) else command))
    blocks: list = [Heading("Setup"), Bullets(tuple(items))]

    impl_i, impl_t = infer.get("implementations", {}), train.get("implementations", {})
    regions = list(dict.fromkeys([*impl_i, *impl_t]))
    if regions:
        blocks.append(Table(
            "implementations",
            "What each region ran as, per stack (from the manifest: the function or kernel each stack dispatched to).",
            (Column("region", "code"), Column(f"inference ({infer.get('name', 'infer')})", "longcode"),
             Column(f"training ({train.get('name', 'train')})", "longcode")),
            tuple((r, impl_i.get(r), impl_t.get(r)) for r in regions)))
    return blocks


def _zero_run(row: pd.Series) -> bool:
    cols = [c for c in HEADLINE if c in row]
    return bool(cols) and all(float(row[c]) == 0.0 for c in cols)


def _headline(run: RunData) -> list:
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
    if "noise_train_kernel_mean_abs_dlogp" in floors:
        parts.append("running the training stack's attention on another SDPA kernel moves its logprobs by "
                     f"{_num(floors['noise_train_kernel_mean_abs_dlogp'])} nats (kernel_noise.csv)")
    if "noise_infer_engine_mode_mean_abs_dlogp" in floors:
        parts.append("the engine in its other mode (eager vs compiled) moves its logprobs by "
                     f"{_num(floors['noise_infer_engine_mode_mean_abs_dlogp'])} nats (engine_noise.csv)")
    if "noise_infer_tensor_parallel_mean_abs_dlogp" in floors:
        parts.append("the engine at tensor_parallel_size 1 instead of this run's moves its logprobs by "
                     f"{_num(floors['noise_infer_tensor_parallel_mean_abs_dlogp'])} nats (engine_noise.csv)")
    if "noise_train_tensor_parallel_mean_abs_dlogp" in floors:
        parts.append("the training stack unsharded instead of this run's --train-tp moves its logprobs by "
                     f"{_num(floors['noise_train_tensor_parallel_mean_abs_dlogp'])} nats (kernel_noise.csv)")
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


def _first_divergence(run: RunData) -> list:
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


def _not_captured(frame: pd.DataFrame) -> list[str]:
    """The tap columns of a run without taps (`--taps none`): they hold only "not captured", so they are left out."""
    return [c for c in ("first_inexact", "first_over_threshold")
            if c in frame and (frame[c].astype(str) == NOT_CAPTURED).all()]


def _summary_table(run: RunData) -> Table:
    s = run.summary
    cols = [c for c in s.columns if c != "combo" and c not in _not_captured(s)]

    def meaning(c: str) -> str:
        if c == "first_over_threshold" and _get(run.manifest, "compare", "threshold") is not None:
            return f"first tap whose rel_l2 exceeds {_get(run.manifest, 'compare', 'threshold')}"
        if run.is_score and c in MEANINGS:
            return MEANINGS[c]
        if c in SUMMARY_MEANINGS or c in REFERENCE_MEANINGS:
            text = SUMMARY_MEANINGS.get(c) or REFERENCE_MEANINGS[c]
            return text.replace("scored tokens", "response tokens") if run.is_generate else text
        if c.startswith("ratio_"):
            return ("importance-ratio statistic, ρ = exp(Δlogprob) on response tokens "
                    "(docs/reference/generate-mode.md)")
        return ""

    def value(v):
        return v.item() if isinstance(v, np.generic) else v

    if "combo" in s:
        shown = [SHIPPED] + ([run.all_aligned] if run.all_aligned and run.all_aligned != SHIPPED else [])
        shown = [c for c in shown if (s["combo"] == c).any()] or [str(s["combo"].iloc[0])]
        rows = tuple((c, *(value(row_of(s, k)[c]) for k in shown), meaning(c)) for c in cols)
        return Table("summary", "Headline numbers (summary.csv): as shipped and with every region aligned.",
                     (Column("quantity", "code"), *(Column(k, "auto") for k in shown), Column("meaning", "prose")),
                     rows)
    if len(s) == 1:
        rows = tuple((c, value(s.iloc[0][c]), meaning(c)) for c in cols)
        return Table("summary", "Headline numbers (summary.csv).",
                     (Column("quantity", "code"), Column("value", "auto"), Column("meaning", "prose")), rows)
    return _generic_table("summary", "Headline numbers (summary.csv).", s)


def _kind(series: pd.Series) -> str:
    if series.dtype == bool:
        return "bool"
    if pd.api.types.is_integer_dtype(series):
        return "int"
    if pd.api.types.is_float_dtype(series):
        return "num"
    return "code"


def _generic_table(name: str, caption: str, df: pd.DataFrame) -> Table:
    columns = tuple(Column(c, _kind(df[c])) for c in df.columns)
    rows = tuple(tuple(None if pd.isna(v) else v for v in row) for row in df.itertuples(index=False, name=None))
    return Table(name, caption, columns, rows)


def _ablation_table(run: RunData) -> Table:
    df = run.ablation.sort_values(run.metric, kind="stable")
    caption = (f"Every combination of aligned regions (ablation.csv), sorted by `{run.metric}`, lowest first; "
               "yes = the region is aligned (FP32 until its output, one rounding).")
    if "n_tokens" in df and df["n_tokens"].nunique() == 1:
        caption += f" Every combination scores the same {int(df['n_tokens'].iloc[0])} tokens."
        df = df.drop(columns=["n_tokens"])
    first = ["combo", *run.regions, run.metric]
    df = df[first + [c for c in df.columns if c not in first and c not in _not_captured(df)]]
    table = _generic_table("ablation", caption, df)
    return Table(table.name, table.caption, tuple(
        Column(c.title, "bool" if c.title in run.regions else c.kind) for c in table.columns), table.rows)


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


def _tables(run: RunData) -> list:
    blocks: list = [Heading("Tables"), _summary_table(run)]
    if run.is_ablate:
        blocks.append(_ablation_table(run))
    if run.attribution is not None:
        words = _attribution_words(run)
        blocks += [*([words] if words else []), _attribution_table(run), _attribution_reading(run)]
    if "buckets" in run.extra:
        b = run.extra["buckets"]
        shown = b[[c for c in BUCKET_COLUMNS if c in b.columns]]
        empty = int((shown["n_tokens"] == 0).sum()) if "n_tokens" in shown else 0
        if empty:
            shown = shown[shown["n_tokens"] > 0]
        blocks.append(_generic_table(
            "buckets", "Response-token metrics per bucket of the inference-side probability of the sampled token "
            "(`group` p_infer) and per response-position range (`group` response_position), from buckets.csv"
            + (f"; {empty} empty buckets left out" if empty else "") + ". The CSV has every token metric per bucket.",
            shown))
    graft = findings({stem: shipped_rows(run.extra[stem]) for stem in ("local_families", "depth")
                      if stem in run.extra}, run.num_layers)
    if graft:
        blocks.append(Paragraph("**Where the gap comes from" + (" (stacks as shipped)" if run.is_ablate else "")
                                + ".** " + " ".join(graft)))
    for stem, caption in EXTRA_TABLES.items():
        if stem == "local_families" and stem in run.extra:
            blocks.append(_families_table(caption, run.extra[stem]))
        elif stem in run.extra:
            blocks.append(_generic_table(stem, caption, run.extra[stem]))
    return blocks


def _families_table(caption: str, families: pd.DataFrame) -> Table:
    """local_families.csv largest local error first, its amplification in words where the local error is 0."""
    table = _generic_table("local_families", caption, families_by_local(families).drop(columns=["amplification"]))
    rows = tuple((*row, amplification_text(record)) for row, record in
                 zip(table.rows, families_by_local(families).to_dict("records")))
    return Table(table.name, table.caption, (*table.columns, Column("amplification", "auto")), rows)


# ---------------------------------------------------------------------------------------------- document
def title(run: RunData) -> str:
    spec = str(_get(run.manifest, "model", "spec", default="model"))
    return f"divergence-probe report: {Path(spec).name or spec}, {run.kind} run"


def _intro(run: RunData) -> Paragraph:
    infer = _get(run.manifest, "stacks", "infer", "name", default=_get(run.manifest, "load", "infer", default="inference"))
    if run.is_score:
        engine = " and, re-scored in one prefill, by the inference engine" if _get(run.manifest, "score", "prefill") \
            else ""
        return Paragraph("This report reads the rollouts a user's RL run recorded (prompt and response token ids, the "
                         "logprobs its engine gave while sampling) and sets those logprobs against the ones the same "
                         f"checkpoint gives the same tokens in the training stack (transformers){engine}. Throughout, "
                         "`logprob_infer` is the recorded logprob (tokens.csv's `logprob_rollout`) and Δlogprob = "
                         "logprob_train − logprob_rollout. Run folder: " + _code(run.path.name) + ".")
    what = {"compare": "compares", "ablate": "ablates", "generate": "compares, on generated rollouts,",
            "remedies": "compares, as shipped and with each candidate remedy,"}[run.kind]
    text = (f"This report {what} the same checkpoint run by an inference engine (`{infer}`) and by a training "
            "stack (transformers), fed exactly the same token ids. Both compute in the same dtype, yet they round "
            "intermediate results at different places, so the policy that samples and the policy that is trained "
            "differ slightly; the report shows where the two first differ, how the difference grows through the "
            "layers, and what it does to token logprobs.")
    if run.is_ablate:
        text += (" The ablation reruns the comparison with regions (RoPE, SwiGLU, residual RMSNorm) computed in "
                 "FP32 until their output, in every combination, and attributes the mismatch to them.")
        if "routing" in run.regions:
            text += " Region `routing` is routing replay: the trainer runs the experts the engine chose."
    return Paragraph(text + f" Run folder: {_code(run.path.name)}.")


def build_document(run: RunData, figure_specs: list, skipped: list[str], figure_files: bool = True) -> list:
    """The report's blocks; `figure_files`: whether the figures are also saved as files (not in a self-contained
    HTML report, whose figures are embedded)."""
    blocks: list = [Heading(title(run), 1), _intro(run)]


    blocks += _setup(run) + _headline(run) + reference_section(run) + (recorded_section(run) if run.is_score else [])
    blocks += _first_divergence(run)
    blocks += routing_section(run) + remedies_section(run) + _tables(run)
    blocks.append(Heading("Figures"))
    if figure_specs and figure_files:
        blocks.append(Paragraph("Each figure is also saved as a vector PDF beside its PNG in `figures/`."))
    blocks += [Paragraph(s) for s in skipped]
    blocks += [Figure(f.stem, f.title, f.caption) for f in figure_specs]
    return blocks
