"""Which side is wrong: each stack's error against a reference forward in higher precision (--reference), and the
verdict a user acts on.

Every other number of a run is a distance between the two stacks; it cannot say which of them is the inaccurate one.
The reference is the same checkpoint run in float64 (or float32) on the same token ids under the same capture, so each
tap and each token has a value both stacks can be measured against. Pure functions here: the sums one sequence
leaves (`error_sums`), the columns of layers.csv, tokens.csv and summary.csv built from them, and the verdict in
words. The reference arm that produces the sums is runs/reference.py.

The floor is what a stack in the run's dtype cannot do better than: the reference's own value rounded once to that
dtype (`floor`). A side within K times the better side plus that floor is as close to exact as the other, in the
sense of torchtitan's kernel numerics gate (target error <= 2 x reference error + floor). Growth tells zero-mean
rounding (an error that adds up like a random walk, sqrt(n)) from a systematic bias (one that adds up like n): the
exponent of a least-squares line through log(error) against log(n).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from .shapley import MIN_PROMPTS, bootstrap

PRECISIONS = {"float64": torch.float64, "float32": torch.float32}  # --reference
K = 2.0  # the worse side is "within K times" the better one when its error <= K x the better's + the floor
DRAWS, LEVEL = 1000, 0.95  # the ratio's bootstrap over prompts, as the noise verdict's (noise_verdict.py)
# the sums one sequence leaves per tap, in this order (error_sums)
SUMS = ("sq_err_infer", "sq_err_train", "sq_ref", "sq_floor", "n")
SIDES = ("infer", "train")
INFER, TRAIN, TIE = "infer", "train", "tie"
# growth exponents: below FLAT the error does not grow; below LINEAR it grows like sqrt(n) (rounding noise adding up
# as a random walk, exponent 1/2); from LINEAR on like n (a bias adding up the same way each time, exponent 1):
# each boundary halfway between the exponents it separates
FLAT, LINEAR = 0.25, 0.75
GROWTH_FLAT, GROWTH_SQRT, GROWTH_LINEAR = "flat", "sqrt(n)", "n"
MIN_GROWTH_POINTS = 3  # a line through fewer points says nothing of its slope
# summary.csv's ref_verdict
TRAIN_FURTHER, INFER_FURTHER, NOT_DETECTED, TOO_FEW, BOTH_EXACT = (
    "train_further", "infer_further", "no_detectable_difference", "too_few_prompts", "both_exact")
LOGPROBS = "logprobs"  # ref_at when no tap diverged (or none was captured): the verdict is read on the logprobs
LAYER_COLUMNS = ["ref_err_infer", "ref_err_train", "ref_floor", "closer_to_ref", "ref_growth_infer",
                 "ref_growth_train", "ref_growth_kind_infer", "ref_growth_kind_train"]
TOKEN_COLUMNS = ["logprob_ref", "ref_err_infer", "ref_err_train", "ref_floor", "closer_to_ref"]


def reference_terms(size, precision: str, batch_tokens: int, longest: int) -> dict[str, int]:
    """What --reference holds on the trainer's device, about (`size`: models.size.ModelSize; the memory plan's terms),
    each element in `precision`: its weights; one inference batch of every tap (the local reading captures them all)
    and its logits (the logits tap), held from the reference's forward of the batch until the trainer has run its last
    sequence; and, while it scores a sequence, that sequence's transients (`reference_forward`, of the batch's
    `longest` sequence)."""
    width = PRECISIONS[precision].itemsize
    batch = batch_tokens * (size.tap_elements_per_token(frozenset(size.tap_widths())) + size.vocab)
    return {"reference_weights": width * size.parameters, "reference_batch": width * batch,
            "reference_forward": reference_forward(size, precision, longest)}


def reference_forward(size, precision: str, longest: int) -> int:
    """The peak the reference reaches scoring one sequence of `longest` tokens, beyond its weights and what it keeps
    of the sequence (its taps and logits: reference_terms' batch), each element in `precision` unless said: the
    larger of its forward's peak and its logprobs' (the forward has freed its transients when they run).

    The forward is transformers' own with eager attention (runs/reference.py ATTENTION; transformers'
    modeling_qwen2.eager_attention_forward, the decoder layer and the model around it). Its peak is one layer's
    attention or that layer's MLP, beside what the model holds for the whole forward:
    - the whole forward: the causal mask eager attention adds to every layer's scores, [tokens, tokens] in
      `precision` (where SDPA would take a boolean one, or none), and RoPE's cos and sin, [tokens, head_dim] each;
    - attention: the scores, [heads, tokens, tokens], and their softmax, which it takes in float32: in float32 one
      more tensor of the scores' size; in float64 a float32 copy of the scores to take it on, then the float32 output
      cast back to float64 while the scores are still held (the copy freed by then): 4 + 8 bytes a score beside the
      scores' 8. Beside them the query and key after RoPE (their taps are reshaped copies, so the capture does not
      hold these) and, with grouped-query attention, the key and value repeated to every head (repeat_kv);
    - the MLP: SiLU of gate_proj's output (not a tap: swiglu is the product), while the softmax's output is still
      held (the decoder layer keeps the attention weights it discards until it returns).
    The logprobs, per logit: the stack's float32 log_softmax (metrics.token_logprobs: of a float64 reference, on a
    float32 copy), the float64 log_softmax (ref_logprobs: of a float32 reference, on a float64 copy), and the floor's
    logits rounded to the run's dtype (2 bytes at most where a copy is made), their float32 upcast and log_softmax;
    one after the other, so the largest counts."""
    width = PRECISIONS[precision].itemsize
    tokens, scores = longest, size.heads * longest * longest
    whole_forward = tokens * tokens * width + 2 * tokens * size.head_dim * width
    softmax = 4 if width == 4 else 4 + width
    repeated = 2 * size.q_width if size.kv_heads < size.heads else 0
    attention = scores * (width + softmax) + tokens * (size.q_width + size.kv_width + repeated) * width
    mlp = scores * width + tokens * size.intermediate * width
    per_logit = max(4 + (4 if width != 4 else 0), 8 + (8 if width != 8 else 0), 2 + 4 + 4)
    return max(whole_forward + max(attention, mlp), tokens * size.vocab * per_logit)


def reference_bytes(size, precision: str, batch_tokens: int, longest: int) -> int:
    """reference_terms, summed: the reference at its largest."""
    return sum(reference_terms(size, precision, batch_tokens, longest).values())


def error_sums(infer: torch.Tensor, train: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One tap of one sequence -> float64 [5] (SUMS): each stack's squared error against the reference, the
    reference's squared norm, the squared error of the reference rounded once to `dtype` (the floor), and the count.
    The stacks' values are exact in float64; the differences are taken there."""
    r = ref.double()
    e_infer = infer.to(r.device, torch.float64) - r
    e_train = train.to(r.device, torch.float64) - r
    e_floor = ref.to(dtype).double() - r
    return torch.stack([(e_infer * e_infer).sum(), (e_train * e_train).sum(), (r * r).sum(),
                        (e_floor * e_floor).sum(), r.new_tensor(float(r.numel()))])


def ref_logprobs(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's logprob of each target, in float64, and the floor's: the reference's logits rounded once to the
    run's `dtype`, then log_softmax in FP32 as both stacks take it (metrics.token_logprobs)."""
    exact = torch.log_softmax(logits.double(), dim=-1).gather(-1, targets[:, None])[:, 0]
    rounded = torch.log_softmax(logits.to(dtype).float(), dim=-1).gather(-1, targets[:, None])[:, 0].double()
    return exact, rounded


def rel(sq_err: float, sq_ref: float) -> float:
    """‖err‖/‖ref‖; 0 when the error is, inf over a zero reference."""
    if sq_err == 0:
        return 0.0
    return math.sqrt(sq_err / sq_ref) if sq_ref else math.inf


def closer(err_infer: float, err_train: float) -> str:
    """The side with the smaller error; "" when a side has none (NaN: a local reading its stack cannot make)."""
    if err_infer != err_infer or err_train != err_train:
        return ""
    return TIE if err_infer == err_train else INFER if err_infer < err_train else TRAIN


def growth_exponent(n: np.ndarray, err: np.ndarray) -> float:
    """The slope of log(err) against log(n) (least squares) over the points with an error above 0; NaN with fewer
    than MIN_GROWTH_POINTS such points or a single n."""
    n, err = np.asarray(n, np.float64), np.asarray(err, np.float64)
    keep = (err > 0) & np.isfinite(err) & (n > 0)
    if keep.sum() < MIN_GROWTH_POINTS or len(set(n[keep])) < 2:
        return math.nan
    return float(np.polyfit(np.log(n[keep]), np.log(err[keep]), 1)[0])


def growth_kind(exponent: float) -> str:
    """flat, sqrt(n) or n (the nearest of exponents 0, 1/2, 1); "" when there is no exponent."""
    if exponent != exponent:
        return ""
    return GROWTH_FLAT if exponent < FLAT else GROWTH_SQRT if exponent < LINEAR else GROWTH_LINEAR


def per_tap(sums: pd.DataFrame) -> pd.DataFrame:
    """Per-sequence sums (columns prompt_id, layer, tap and SUMS) -> one row per (layer, tap): each side's rel_l2
    against the reference, the floor's, which side is closer."""
    # min_count: a side with no error at all (NaN: a local reading its stack cannot make) stays NaN, not 0
    totals = sums.groupby(["layer", "tap"], sort=False)[list(SUMS)].sum(min_count=1).reset_index()
    out = pd.DataFrame({"layer": totals["layer"], "tap": totals["tap"]})
    for side in SIDES:
        out[f"ref_err_{side}"] = [rel(e, r) for e, r in zip(totals[f"sq_err_{side}"], totals["sq_ref"])]
    out["ref_floor"] = [rel(e, r) for e, r in zip(totals["sq_floor"], totals["sq_ref"])]
    out["closer_to_ref"] = [closer(a, b) for a, b in zip(out["ref_err_infer"], out["ref_err_train"])]
    # growth over layers: the absolute RMS error of each tap name against its layer number n = layer + 1 (an error
    # adds up over the layers a stream has passed; the embedding and the head are no layers)
    for side in SIDES:
        rms = np.sqrt(totals[f"sq_err_{side}"] / totals["n"].where(totals["n"] > 0))
        exponents = {}
        for tap, rows in out.assign(rms=rms).groupby("tap", sort=False):
            layers = rows[rows["layer"] >= 0]
            exponents[tap] = growth_exponent(layers["layer"] + 1, layers["rms"])
        out[f"ref_growth_{side}"] = out["tap"].map(exponents)
        out[f"ref_growth_kind_{side}"] = out[f"ref_growth_{side}"].map(growth_kind)
    return out


def layer_columns(layers: pd.DataFrame, sums: pd.DataFrame) -> pd.DataFrame:
    """layers.csv with the reference's columns (LAYER_COLUMNS) beside the stacks' own."""
    return layers.merge(per_tap(sums), on=["layer", "tap"], how="left")


def token_columns(tokens: pd.DataFrame, logprob_ref: np.ndarray, floor: np.ndarray) -> pd.DataFrame:
    """tokens.csv with the reference's logprob of each token (in the order the run scored them), each stack's
    |logprob - logprob_ref|, the floor's (the reference's logits rounded once to the run's dtype) and the side
    closer."""
    if len(logprob_ref) != len(tokens):
        raise ValueError(f"the reference scored {len(logprob_ref)} tokens, the run {len(tokens)}")
    out = tokens.copy()
    out["logprob_ref"] = logprob_ref
    for side in SIDES:
        out[f"ref_err_{side}"] = (out[f"logprob_{side}"].astype(np.float64) - out["logprob_ref"]).abs()
    out["ref_floor"] = floor
    out["closer_to_ref"] = [closer(a, b) for a, b in zip(out["ref_err_infer"], out["ref_err_train"])]
    return out


def _ratio_interval(per_prompt: pd.DataFrame, columns: tuple[str, str], root: bool, seed: int
                    ) -> tuple[float, float]:
    """The bootstrap interval over prompts of Σw·train / Σw·infer (its square root for squared errors, `root`):
    both sides' sums of the same prompts, one weight per prompt shared by the two."""
    infer, train = (per_prompt[c].to_numpy(np.float64) for c in columns)

    def ratio(w: np.ndarray) -> dict[str, float]:
        a, b = w @ train, w @ infer
        value = a / b if b else math.nan
        return {"ratio": math.sqrt(value) if root and value == value else value}

    return bootstrap(len(per_prompt), ratio, DRAWS, seed, LEVEL)["ratio"]


def _verdict(err_infer: float, err_train: float, low: float, high: float, n_prompts: int) -> str:
    if err_infer == 0 and err_train == 0:
        return BOTH_EXACT
    if n_prompts < MIN_PROMPTS:
        return TOO_FEW
    if low > 1:
        return TRAIN_FURTHER
    if high < 1:
        return INFER_FURTHER
    return NOT_DETECTED


def _reading(err_infer: float, err_train: float, floor: float, interval: tuple[float, float], n_prompts: int,
             prefix: str) -> dict:
    low, high = interval
    ratio = err_train / err_infer if err_infer else (math.inf if err_train else math.nan)
    worse, better = max(err_infer, err_train), min(err_infer, err_train)
    return {f"{prefix}_err_infer": err_infer, f"{prefix}_err_train": err_train, f"{prefix}_floor": floor,
            f"{prefix}_further": closer(err_train, err_infer),  # the side further away: the closer one swapped
            f"{prefix}_ratio": ratio, f"{prefix}_ratio_ci_low": low, f"{prefix}_ratio_ci_high": high,
            f"{prefix}_within_k": bool(worse <= K * better + floor),
            f"{prefix}_verdict": _verdict(err_infer, err_train, low, high, n_prompts)}


def summary_columns(reference: str, sums: pd.DataFrame, tokens: pd.DataFrame, start: str, seed: int) -> dict:
    """summary.csv's reference columns. `start`: the tap label where the mismatch starts (first_over_threshold, else
    first_inexact), or LOGPROBS when no tap diverged. The tap's reading (ref_*) is rel_l2 against the reference; the
    logprobs' (ref_logprob_*) mean |logprob - logprob_ref|. Each with the train/infer ratio's interval over prompts.
    `tokens`: tokens.csv with token_columns' columns (response tokens only in generate mode)."""
    n_prompts = int(tokens["prompt_id"].nunique())
    columns = {"reference": reference, "ref_at": start, "ref_k": K, "ref_prompts": n_prompts}
    per_prompt = tokens.groupby("prompt_id", sort=True)[["ref_err_infer", "ref_err_train"]].sum()
    n = len(tokens)
    mean = (lambda c: float(tokens[c].mean())) if n else (lambda c: math.nan)
    logprob = _reading(mean("ref_err_infer"), mean("ref_err_train"), mean("ref_floor"),
                       _ratio_interval(per_prompt, ("ref_err_infer", "ref_err_train"), False, seed), n_prompts,
                       "ref_logprob")
    if start == LOGPROBS:
        tap = {k.replace("ref_logprob_", "ref_"): v for k, v in logprob.items()}
    else:
        name, layer = start.rsplit("@", 1)
        rows = sums[(sums["tap"] == name) & (sums["layer"] == int(layer))]
        by_prompt = rows.groupby("prompt_id", sort=True)[list(SUMS)].sum()
        total = by_prompt.sum()
        tap = _reading(rel(total["sq_err_infer"], total["sq_ref"]), rel(total["sq_err_train"], total["sq_ref"]),
                       rel(total["sq_floor"], total["sq_ref"]),
                       _ratio_interval(by_prompt, ("sq_err_infer", "sq_err_train"), True, seed), n_prompts, "ref")
    growth = {}
    for side in SIDES:  # over positions: the mean error of the tokens in each power-of-two range of positions
        bins = np.floor(np.log2(tokens["position"].to_numpy(np.float64)))
        binned = tokens.assign(bin=bins).groupby("bin")[["position", f"ref_err_{side}"]].mean()
        exponent = growth_exponent(binned["position"], binned[f"ref_err_{side}"]) if n else math.nan
        growth |= {f"ref_position_growth_{side}": exponent, f"ref_position_growth_kind_{side}": growth_kind(exponent)}
    return columns | tap | logprob | growth


def start_of(summary: dict) -> str:
    """Where the mismatch starts, as the summary says it: the first tap over the threshold, else the first inexact
    one, else the logprobs (no tap diverged, or none was captured)."""
    for key in ("first_over_threshold", "first_inexact"):
        label = summary.get(key)
        if isinstance(label, str) and "@" in label:
            return label
    return LOGPROBS


SIDE_WORDS = {INFER: "the inference stack", TRAIN: "the training stack"}


def in_words(summary) -> str | None:
    """The verdict as a user reads it: which side is further from the reference where the mismatch starts, by how
    much with its interval, whether the worse side is within K times the better one (K and the floor named), and how
    each side's error grows over positions. None when the run had no reference."""
    reference = summary.get("reference")
    if not isinstance(reference, str):
        return None
    at = summary["ref_at"]
    where = "on the logprobs (no tap diverged)" if at == LOGPROBS else f"at {at}, where the mismatch starts"
    measure = "mean |logprob - logprob_ref|" if at == LOGPROBS else "rel_l2 against the reference"
    e_infer, e_train, floor = (float(summary[k]) for k in ("ref_err_infer", "ref_err_train", "ref_floor"))
    ratio, low, high = (float(summary[k]) for k in ("ref_ratio", "ref_ratio_ci_low", "ref_ratio_ci_high"))
    verdict = summary["ref_verdict"]
    errors = f"errors ({measure}): inference {e_infer:.3g}, training {e_train:.3g}"
    floor_words = f"the floor, the reference rounded once to the run's dtype, is {floor:.3g}"
    if verdict == BOTH_EXACT:
        return f"Against {reference}, {where}: both stacks equal the reference exactly."
    interval = (f"{LEVEL:.0%} interval over prompts {low:.4g}x to {high:.4g}x" if low == low and high == high else
                f"no interval: fewer than {MIN_PROMPTS} prompts")
    lead = {TRAIN_FURTHER: "the training stack is further from exact",
            INFER_FURTHER: "the inference stack is further from exact",
            NOT_DETECTED: "neither stack is detectably further from exact",
            TOO_FEW: f"which stack is further from exact cannot be told on {summary.get('ref_prompts')} prompts "
                     f"(it needs at least {MIN_PROMPTS})"}[verdict]
    within = "within" if summary["ref_within_k"] else "not within"
    text = (f"Against {reference}, {where}: {lead}; the training stack's error is {ratio:.4g}x the inference "
            f"stack's ({interval}); {errors}; {floor_words}; the worse side is {within} {K:g}x the better one plus "
            "the floor.")
    kinds = [summary.get(f"ref_position_growth_kind_{side}") for side in SIDES]
    if all(isinstance(k, str) and k for k in kinds):
        text += (f" Over positions the logprob error grows like {kinds[0]} on the inference side and like {kinds[1]} "
                 "on the training side (flat: no growth; sqrt(n): rounding noise; n: a systematic bias).")
    return text


def combination_lines(ablation: pd.DataFrame, tokens: pd.DataFrame | None, shipped: str, seed: int) -> list[str]:
    """ablate: each combination's logprob error against the reference beside the shipped one's, so a user sees
    whether aligning a region moves the trainer toward exact arithmetic or only toward the engine (the logprobs: the
    one reading every combination has at the same place; ablation.csv has each one's tap reading too). The direction
    is read from the change's interval over prompts (`tokens`: the ablation's stacked tokens.csv, response tokens only
    in generate mode), not from its point value; without the tokens, or below MIN_PROMPTS prompts, no direction is
    claimed. Empty without a reference."""
    if "reference" not in ablation or not ablation["reference"].map(lambda v: isinstance(v, str)).all():
        return []
    rows = ablation.set_index("combo")
    base = rows.loc[shipped]
    per_prompt = _trainer_sums(tokens)
    lines = [f"Against {base['reference']}: mean |logprob - logprob_ref| of each combination, the training stack's "
             "(the inference stack's) and the mismatch between them:"]
    for combo, row in rows.iterrows():
        change = "" if combo == shipped else "; " + _moved(per_prompt, shipped, combo, seed)
        lines.append(f"  {combo}: {row['ref_logprob_err_train']:.3g} ({row['ref_logprob_err_infer']:.3g}), mismatch "
                     f"{row['mean_abs_dlogp']:.3g}{change}")
    return lines


def _trainer_sums(tokens: pd.DataFrame | None) -> pd.DataFrame | None:
    """Per prompt (rows) and combination (columns): the trainer's summed |logprob - logprob_ref|, and the count."""
    if tokens is None or "ref_err_train" not in tokens:
        return None
    if "is_response" in tokens:
        tokens = tokens[tokens["is_response"].astype(bool)]
    grouped = tokens.groupby(["prompt_id", "combo"])["ref_err_train"]
    return pd.concat({"sum": grouped.sum().unstack("combo"), "n": grouped.size().unstack("combo")}, axis=1)


def _moved(per_prompt: pd.DataFrame | None, shipped: str, combo: str, seed: int) -> str:
    """The trainer's change of mean |logprob - logprob_ref| from `shipped` to `combo`, worded from its bootstrap
    interval over prompts (both combinations' sums of a prompt drawn together)."""
    if per_prompt is None:
        return "no interval (tokens.csv not read): no direction claimed"
    a, b = per_prompt["sum"][shipped].to_numpy(np.float64), per_prompt["sum"][combo].to_numpy(np.float64)
    n = per_prompt["n"][shipped].to_numpy(np.float64)
    change = float((b.sum() - a.sum()) / n.sum())
    low, high = bootstrap(len(a), lambda w: {"change": float((w @ b - w @ a) / (w @ n))}, DRAWS, seed, LEVEL)["change"]
    if not (low == low and high == high):
        return f"the trainer's error changed by {change:+.3g} (no interval: fewer than {MIN_PROMPTS} prompts)"
    span = f"{change:+.3g}, {LEVEL:.0%} interval {low:+.3g} to {high:+.3g}"
    if high < 0:
        return f"the trainer moved toward exact ({span})"
    if low > 0:
        return f"the trainer moved away from exact ({span})"
    return f"no detectable move of the trainer ({span})"


LOCAL_COLUMNS = ["layer", "tap", "ref_err_infer", "ref_err_train", "ref_floor", "closer_to_ref"]


def local_frame(local: pd.DataFrame) -> pd.DataFrame:
    """reference_local.csv: per seam (tap, layer), each stack's op on the reference's inputs against the reference's
    output (rel_l2; NaN for a stack that cannot replay its ops), the floor's, and the side closer."""
    return per_tap(local)[LOCAL_COLUMNS]
