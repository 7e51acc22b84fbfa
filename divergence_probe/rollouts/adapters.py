"""Each RL framework's field names, mapped to one Rollout. Data, not code paths: an adapter names the fields that
identify its format and turns one row into a Rollout; `--fields` builds the generic one for anything else.

Field names are the frameworks' own (facts taken from their sources, cited per adapter); padded tensors dumped row
by row are unpadded with the masks the framework keeps beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .formats import EXPORT_FORMATS
from .record import Rollout, RolloutError, field, logprobs, mask, same_length, token_ids


@dataclass(frozen=True)
class Adapter:
    name: str
    signature: tuple[str, ...]  # fields whose presence identifies the format (auto-detection)
    read: Callable[[dict, int], Rollout]
    train: str = ""  # the field where the framework keeps its trainer's logprobs of the same tokens (columns.py)
    # one sample as a row of this layout (prompt ids, response ids, their logprobs, the group): what a generate-mode
    # run exports, so that a user sees their own framework's layout and `score` reads it back as such
    write: Callable[[list, list, list, object], dict] | None = None

    @property
    def logprobs(self) -> str:
        """The field of the engine's logprobs (the last of the signature, in every format)."""
        return self.signature[-1]


def _kept(values: list, keep: list[bool] | None) -> list:
    return values if keep is None else [v for v, k in zip(values, keep) if k]


def _verl(row: dict, at: int) -> Rollout:
    # verl's DataProto batch (verl/trainer/ppo/ray_trainer.py, verl/workers/rollout/vllm_rollout): `prompts`
    # (left-padded), `responses` (right-padded), `input_ids` = prompts ++ responses, `attention_mask` over both,
    # `response_mask`, `rollout_log_probs` aligned with `responses`; non-tensor `uid` groups a prompt's samples
    # (GRPO); `routed_experts` with router replay.
    prompt, response = token_ids(row, "prompts", at), token_ids(row, "responses", at)
    lps = logprobs(row, "rollout_log_probs", at)
    same_length(at, "responses", response, "rollout_log_probs", lps)
    if row.get("input_ids") is not None and token_ids(row, "input_ids", at) != prompt + response:
        raise RolloutError(f"row {at}: `input_ids` is not `prompts` followed by `responses`; the response is not "
                           "this prompt's continuation, so the row mixes two samples: re-export the rollout")
    attention = mask(row, "attention_mask", at, len(prompt) + len(response))
    if attention is not None:
        keep_prompt, keep_response = attention[: len(prompt)], attention[len(prompt):]
    else:
        keep_prompt, keep_response = None, mask(row, "response_mask", at, len(response))
    return Rollout(at, tuple(_kept(prompt, keep_prompt)), tuple(_kept(response, keep_response)),
                   tuple(_kept(lps, keep_response)), row.get("uid"), row.get("routed_experts"))


def _openrlhf(row: dict, at: int) -> Rollout:
    # OpenRLHF's rollout Sample / Experience (openrlhf/trainer/ppo_utils/experience_maker.py): `sequences` =
    # prompt (left-padded) ++ response, `attention_mask` over sequences, `action_mask` over the last A tokens (the
    # actions), `rollout_log_probs` (B, A) from vLLM, aligned with `action_mask`.
    seq = token_ids(row, "sequences", at)
    actions = field(row, "action_mask", at)
    n = len(actions) if isinstance(actions, (list, tuple)) else -1
    if not 0 < n < len(seq):
        raise RolloutError(f"row {at}: `action_mask` has {n} entries for {len(seq)} tokens in `sequences`; the row is "
                           "ragged (the actions are the last tokens of the sequence, after at least one prompt token)")
    keep_response = mask(row, "action_mask", at, n)
    lps = logprobs(row, "rollout_log_probs", at)
    same_length(at, "action_mask", actions, "rollout_log_probs", lps)
    attention = mask(row, "attention_mask", at, len(seq))
    prompt = _kept(seq[:-n], attention[:-n] if attention is not None else None)
    return Rollout(at, tuple(prompt), tuple(_kept(seq[-n:], keep_response)), tuple(_kept(lps, keep_response)),
                   row.get("group"))


def _slime(row: dict, at: int) -> Rollout:
    # slime's / Miles' Sample (slime/utils/types.py): `tokens` = prompt ++ response, `response_length`,
    # `rollout_log_probs` (one per response token), `rollout_routed_experts`, `group_index` (a prompt's samples).
    tokens = token_ids(row, "tokens", at)
    n = field(row, "response_length", at)
    if type(n) is not int or not 0 < n < len(tokens):
        raise RolloutError(f"row {at}: `response_length` is {n!r} for {len(tokens)} tokens; the row is ragged (the "
                           "response must be the last tokens, after at least one prompt token)")
    lps = logprobs(row, "rollout_log_probs", at)
    same_length(at, "tokens[-response_length:]", tokens[-n:], "rollout_log_probs", lps)
    return Rollout(at, tuple(tokens[:-n]), tuple(tokens[-n:]), tuple(lps), row.get("group_index"),
                   row.get("rollout_routed_experts"))


def _trl(row: dict, at: int) -> Rollout:
    # TRL's GRPOTrainer with vLLM (trl/trainer/grpo_trainer.py, `_generate_and_score_completions`): `prompt_ids`
    # (left-padded, `prompt_mask`), `completion_ids` (right-padded, `completion_mask`) and
    # `sampling_per_token_logps`, vLLM's logprob of each completion token (importance-sampling correction).
    prompt, completion = token_ids(row, "prompt_ids", at), token_ids(row, "completion_ids", at)
    lps = logprobs(row, "sampling_per_token_logps", at)
    same_length(at, "completion_ids", completion, "sampling_per_token_logps", lps)
    keep_prompt = mask(row, "prompt_mask", at, len(prompt))
    keep = mask(row, "completion_mask", at, len(completion))
    return Rollout(at, tuple(_kept(prompt, keep_prompt)), tuple(_kept(completion, keep)), tuple(_kept(lps, keep)),
                   row.get("group"))


GENERIC_FIELDS = {"prompt_ids": "prompt_ids", "response_ids": "response_ids", "logprobs": "logprobs",
                  "group": "group", "routed_experts": "routed_experts"}


def _write_generic(prompt: list, response: list, lps: list, group) -> dict:
    f = GENERIC_FIELDS
    return {f["prompt_ids"]: prompt, f["response_ids"]: response, f["logprobs"]: lps, f["group"]: group}


def generic(names: dict[str, str]) -> Adapter:
    """Prompt ids, response ids and their logprobs in fields of any name (`--fields prompt_ids=a,...`)."""
    f = GENERIC_FIELDS | names

    def read(row: dict, at: int) -> Rollout:
        prompt, response = token_ids(row, f["prompt_ids"], at), token_ids(row, f["response_ids"], at)
        lps = logprobs(row, f["logprobs"], at)
        same_length(at, f["response_ids"], response, f["logprobs"], lps)
        return Rollout(at, tuple(prompt), tuple(response), tuple(lps), row.get(f["group"]),
                       row.get(f["routed_experts"]))

    return Adapter("generic", (f["prompt_ids"], f["response_ids"], f["logprobs"]), read, "train_logprobs",
                   _write_generic if not names else None)


# The trainer's logprobs of the same tokens, where each framework keeps them beside the engine's: verl's actor
# recomputes `old_log_probs`; OpenRLHF's Experience holds `action_log_probs`; slime's training batch `log_probs`;
# TRL's GRPOTrainer `old_per_token_logps`.
# A sample written in each layout, unpadded (every mask entry 1), grouped by the field the layout groups by.
ADAPTERS = {
    "verl": Adapter("verl", ("prompts", "responses", "rollout_log_probs"), _verl, "old_log_probs",
                    lambda p, r, lps, g: {"prompts": p, "responses": r, "rollout_log_probs": lps, "uid": g}),
    "openrlhf": Adapter("openrlhf", ("sequences", "action_mask", "rollout_log_probs"), _openrlhf, "action_log_probs",
                        lambda p, r, lps, g: {"sequences": p + r, "action_mask": [1] * len(r),
                                              "rollout_log_probs": lps, "group": g}),
    "slime": Adapter("slime", ("tokens", "response_length", "rollout_log_probs"), _slime, "log_probs",
                     lambda p, r, lps, g: {"tokens": p + r, "response_length": len(r), "rollout_log_probs": lps,
                                           "group_index": g}),
    "trl": Adapter("trl", ("prompt_ids", "completion_ids", "sampling_per_token_logps"), _trl, "old_per_token_logps",
                   lambda p, r, lps, g: {"prompt_ids": p, "completion_ids": r, "sampling_per_token_logps": lps,
                                         "group": g}),
}
FORMATS = ("auto", *EXPORT_FORMATS)


def export_row(fmt: str, prompt: list, response: list, lps: list, group) -> dict:
    """One sample as a row of layout `fmt` (EXPORT_FORMATS)."""
    adapter = ADAPTERS[fmt] if fmt in ADAPTERS else generic({})
    return adapter.write(list(prompt), list(response), list(lps), group)


# The two logprob columns, nameable in any format: `infer` (the engine's, in place of the format's own field) and
# `train` (the trainer's, in place of Adapter.train).
LOGPROB_FIELDS = ("infer", "train")


def parse_fields(text: str | None) -> dict[str, str]:
    """`prompt_ids=a,response_ids=b` -> {"prompt_ids": "a", ...}; only the generic fields and LOGPROB_FIELDS may be
    named."""
    if not text:
        return {}
    names = {}
    for part in text.split(","):
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not value or key not in (*GENERIC_FIELDS, *LOGPROB_FIELDS):
            raise RolloutError(f"--fields {text!r}: each entry is NAME=COLUMN with NAME one of "
                               f"{', '.join((*GENERIC_FIELDS, *LOGPROB_FIELDS))} (e.g. "
                               "prompt_ids=prompt,response_ids=ids,logprobs=lp, or infer=COL,train=COL)")
        names[key] = value
    return names


def choose(fmt: str, fields: dict[str, str], first_row: dict) -> Adapter:
    """The adapter for --format (auto: the one whose signature fields the first row has); one line when none or
    several fit."""
    if fmt not in FORMATS:
        raise RolloutError(f"--format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    generic_names = {k: v for k, v in fields.items() if k not in LOGPROB_FIELDS}
    if generic_names and fmt not in ("auto", "generic"):
        raise RolloutError(f"--fields {', '.join(generic_names)} name the columns of the generic format; drop --format "
                           f"{fmt} or those --fields (infer= and train= fit any format)")
    if generic_names or fmt == "generic":
        return generic(generic_names)
    if fmt != "auto":
        return ADAPTERS[fmt]
    renamed = "infer" in fields  # the engine's logprobs under another name: the format is told by its id fields
    fits = [a for a in [*ADAPTERS.values(), generic({})]
            if set(a.signature[:-1] if renamed else a.signature) <= set(first_row)]
    if len(fits) == 1:
        return fits[0]
    if not fits:
        raise RolloutError(f"the rollout file's fields ({', '.join(sorted(map(str, first_row))[:12])}) match no known "
                           f"format; pass --format ({', '.join(FORMATS[1:])}) or name the columns with --fields "
                           "prompt_ids=...,response_ids=...,logprobs=...")
    raise RolloutError(f"the rollout file's fields fit several formats ({', '.join(a.name for a in fits)}); pass "
                       "--format to say which")
