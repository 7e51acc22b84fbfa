"""score: what the user's own RL run saw. Read the rollouts it recorded (prompt and response token ids, the
engine's logprobs), score every response token with the training stack exactly as generate mode's trainer side
does, and write generate mode's files with the recorded logprobs where generate mode has the engine's.

    from divergence_probe.runs.score import score
    run = score("rollouts/step_12.parquet", model="Qwen/Qwen3-0.6B")   # trainer only
    run = score("dump.jsonl.gz", model=..., infer="vllm")              # + the engine's prefill of each sequence
    run.write("runs/step12")

With `infer="vllm"` the engine re-scores the exact sequences in one prefill, which splits the run's mismatch in
three: recorded vs prefill (the decode path, or the recording), prefill vs trainer (the engine's numerics), and
recorded vs trainer (what the run's importance ratios saw). When the recorded logprobs are far from both, the
summary names the explanation that fits (a flag, not a verdict): a sampling temperature applied on one side only,
tokens the model would hardly sample (wrong tokens), or other weights than these (stale weights).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .loop import ScoredSequence, SequenceSource, score_both
from .history import Draw, History, write_history
from ..reports.gate import Gate
from .manifest import build_manifest, model_section
from .progress import Progress, phase
from .scored import FAR_FACTOR, FAR_FLOOR, FIT_TEMPERATURES, ScoreRun, TokenScore, numbered
from ..engines.protocol import PromptScores
from ..engines import stack_class
from ..errors import NumericsError, ProbeError, one_line
from ..numerics.metrics import token_kl, token_logprobs
from ..prompts import Prompt
from ..rollouts import RolloutBatch, RolloutError, read_rollouts
from ..spec.generate import GenerateSpec
from ..spec.load import LoadSpec
from ..spec.score import ScoreSpec

def check_fits(batch: RolloutBatch, tokenizer, vocab_size: int, max_model_len: int, engine: bool = False) -> None:
    """Every id is one of the model's tokens and decodes; every sequence fits the context, and with the `engine`'s
    prefill one position less: vLLM keeps one for the token it samples after the prompt (as compare's prompts)."""
    limit = max_model_len - 1 if engine else max_model_len
    for r in batch.rollouts:
        for name, ids in (("prompt", r.prompt_ids), ("response", r.response_ids)):
            top = max(ids)
            if top >= vocab_size:
                raise RolloutError(f"row {r.row}: {name} token id {top} is past the model's vocabulary of "
                                   f"{vocab_size}; the rollouts were made with another model or tokenizer: pass that "
                                   "--model")
        n = len(r.prompt_ids) + len(r.response_ids)
        if n > max_model_len:
            raise RolloutError(f"row {r.row}: {n} tokens are more than the model's context of {max_model_len}; the "
                               "rollouts were made with another model: pass that --model")
        if n > limit:
            raise RolloutError(f"row {r.row}: {n} tokens do not fit the engine's prefill with the model's context of "
                               f"{max_model_len} tokens (one position is kept for the sampled token); use at most "
                               f"{limit} tokens per row, or score it without --infer vllm")
        try:  # an id the tokenizer lacks but the embedding has (padded vocabularies) is a token the model can sample
            tokenizer.decode(list(r.prompt_ids + r.response_ids))
        except Exception as e:  # tokenizers raise OverflowError, TypeError, ... for ids they cannot map
            raise RolloutError(f"row {r.row}: the token ids do not decode with the model's tokenizer "
                               f"({one_line(e, 80)}); the rollouts were made with another tokenizer: pass that "
                               "--model") from e


@dataclass
class Scorer:
    """What scoring needs: the training stack, the tokenizer and the model's limits; `infer` for the prefill."""

    train: object
    tokenizer: object
    vocab_size: int
    max_model_len: int
    batch_tokens: int
    manifest: dict = field(default_factory=dict)
    infer: object | None = None

    def close(self) -> None:
        """Free the engine and the trainer."""
        if self.infer is not None:
            self.infer.close()
        self.train.close()

    @classmethod
    def of_probe(cls, probe, prefill: bool = False) -> "Scorer":
        """A loaded Probe's training stack (and its engine, for `prefill`): no second load."""
        return cls(probe.train, probe.tokenizer, vocab_size(probe.source.config, probe.tokenizer),
                   probe.settings.max_model_len, probe.settings.batch_tokens, probe.manifest(),
                   probe.infer if prefill else None)


def vocab_size(config: dict, tokenizer) -> int:
    text = config.get("text_config", config)
    return int(text.get("vocab_size") or len(tokenizer))


@dataclass
class RecordedSides:
    """What compare's run loop asks of a probe, for score: the recorded rollouts on the inference side, the
    training stack on the other."""

    infer: object  # the registry's "recorded" stack
    train: object


class RecordedSource(SequenceSource):
    """score's batches: the recorded rollouts are each batch's inference side, and with `engine` its prefill of the
    same batch (before the trainer runs it, as generate mode's) makes the third column; its scheduler's limit then
    bounds a batch. `prefill`: the engine's scores of the current batch, by sequence."""

    def __init__(self, batch_tokens: int, engine=None) -> None:
        self._batch_tokens, self.engine, self.prefill = batch_tokens, engine, {}

    def batch_tokens(self, probe) -> int:
        return self._batch_tokens

    def batch_count(self, probe) -> int | None:
        return (probe.infer if self.engine is None else self.engine).capabilities().max_sequences_per_step

    def run(self, probe, group, taps, park, first_key):
        if self.engine is not None:
            scores = self.engine.score(group, frozenset(), park)
            self.prefill = {s.prompt_id: s for s in scores}
        return super().run(probe, group, taps, park, first_key)


@dataclass
class ResponseScores:
    """One sequence's response tokens, scored as it ran (the loop collects them one sequence late)."""

    tokens: list[TokenScore]

    def read(self) -> list[TokenScore]:
        return self.tokens


class _NoTaps:
    """The run loop's capture, for a run that captures no taps."""

    def park(self, *_) -> None: ...

    def pair(self, *_) -> None: ...

    def add_sequences(self, _) -> None: ...

    def finish_prompt(self, _) -> None: ...


NO_TAPS = _NoTaps()


def score_batch(scorer: Scorer, batch: RolloutBatch, *, temperature: float | None = None, clip_eps: float | None = None,
                tis_cap: float | None = None, progress: Progress | None = None) -> ScoreRun:
    """Score `batch` (checked against the model first) in compare's run loop: the recorded rollouts are the
    inference side (RecordedStack), the scorer's training stack the training side, sequence by sequence as generate
    mode's trainer side runs them, and the engine's prefill of each batch the third column when the scorer has an
    engine. `progress(done, total)`: after each sequence (compare.Progress)."""
    g = GenerateSpec(**{k: v for k, v in (("clip_eps", clip_eps), ("tis_cap", tis_cap)) if v is not None})
    if temperature is not None and not temperature > 0:
        raise ProbeError(f"--temperature {temperature} must be > 0: it is the sampling temperature to test against")
    check_fits(batch, scorer.tokenizer, scorer.vocab_size, scorer.max_model_len, engine=scorer.infer is not None)
    ids = numbered(batch)
    sequences = [Prompt(i, f"{batch.path.name} row {r.row}", "", r.prompt_ids + r.response_ids)
                 for i, r in enumerate(batch.rollouts)]
    sides = RecordedSides(stack_class("recorded")({i: r.logprobs for i, r in enumerate(batch.rollouts)}), scorer.train)
    source = RecordedSource(scorer.batch_tokens, scorer.infer)
    tokens: list[TokenScore] = []
    # With --temperature every logprob of the comparison is at that temperature (the trainer's, the engine's prefill,
    # the KL), as a recording made at it holds them; the trainer's raw ones are kept for the diagnosis. Without it,
    # the recording's gap to the trainer at each of FIT_TEMPERATURES, for the diagnosis to test a temperature.
    untempered: list[float] | None = [] if temperature is not None else None
    fit_sums = dict.fromkeys(FIT_TEMPERATURES if temperature is None else (), 0.0)

    def response_scores(seq: ScoredSequence, train: PromptScores) -> ResponseScores:
        r, (pid, sid) = batch.rollouts[seq.prompt_id], ids[seq.prompt_id]
        start = len(r.prompt_ids) - 1  # the logit row that predicts the first response token
        logits = train.logits[start:]
        if not torch.isfinite(logits).all():
            raise NumericsError(f"the training stack's logits for row {r.row} are not finite; the model or its "
                                "dtype is broken: try --dtype float32")
        lp_train = train.logprobs[start:].double().tolist()
        recorded = seq.logprobs[start:].tolist()
        target = torch.tensor(r.response_ids, device=logits.device)
        if temperature is not None:
            untempered.extend(lp_train)
            logits = logits.float() / temperature
            lp_train = token_logprobs(logits, target).double().tolist()
        if fit_sums:
            rec = torch.tensor(recorded, dtype=torch.float64)
            for t in fit_sums:
                fit_sums[t] += float((rec - token_logprobs(logits.float() / t, target).double().cpu()).abs().sum())
        kl = [math.nan] * len(lp_train)
        prefill = [None] * len(lp_train)
        engine = source.prefill.get(seq.prompt_id)
        if engine is not None:
            if temperature is None:
                prefill = engine.logprobs[start:].double().tolist()
                kl = token_kl(engine.logits[start:], logits.to(engine.logits.device)).tolist()
            else:
                at_t = engine.logits[start:].float() / temperature
                prefill = token_logprobs(at_t, target.to(at_t.device)).double().tolist()
                kl = token_kl(at_t, logits.to(at_t.device)).tolist()
        names = scorer.tokenizer.convert_ids_to_tokens(list(r.response_ids))
        return ResponseScores([TokenScore(pid, len(r.prompt_ids) + j, tok, names[j], recorded[j], lp_train[j], kl[j],
                                          sid, True, prefill[j]) for j, tok in enumerate(r.response_ids)])

    def collect(scores: ResponseScores) -> None:
        tokens.extend(scores.read())
        collect.done += 1
        if progress is not None:
            progress(collect.done, len(sequences))

    collect.done = 0

    phase(progress, "scoring sequences")
    score_both(sides, sequences, source, frozenset(), frozenset(), NO_TAPS, collect, make_scores=response_scores)
    prompts = _prompts(batch, ids, scorer.tokenizer)
    manifest = build_manifest("score", scorer.manifest, {"score": {
        "rollouts": str(batch.path), "rollouts_sha256": batch.sha256, "format": batch.format,
        "n_rollouts": len(batch.rollouts), "prefill": scorer.infer is not None, "temperature": temperature,
        "clip_eps": g.clip_eps, "tis_cap": g.tis_cap, "far_factor": FAR_FACTOR, "far_floor": FAR_FLOOR,
        "routed_experts_recorded": sum(r.routed_experts is not None for r in batch.rollouts),
        "logprobs": "recorded: as the file holds them; train (and prefill, kl): "
                    + ("raw (untempered) log-softmax, as generate mode" if temperature is None else
                       f"log-softmax of the logits divided by the temperature {temperature}")}})
    if scorer.infer is None:
        manifest.get("load", {}).pop("infer", None)
        manifest.get("stacks", {}).pop("infer", None)
    fitted = {t: total / len(tokens) for t, total in fit_sums.items()} if tokens else {}
    return ScoreRun(batch, prompts, tokens, untempered, manifest, g.clip_eps, g.tis_cap, temperature, fitted)


def _prompts(batch: RolloutBatch, ids, tokenizer) -> list[Prompt]:
    """prompts.jsonl: each prompt once (the first row of its group)."""
    out = {}
    for r, (pid, _) in zip(batch.rollouts, ids):
        if pid not in out:
            out[pid] = Prompt(pid, f"{batch.path.name} row {r.row}", tokenizer.decode(list(r.prompt_ids)), r.prompt_ids)
    return list(out.values())


def load_scorer(spec: LoadSpec, infer: str | None, check=None) -> Scorer:
    """The training stack alone (and the engine `infer` for its prefill, through divergence_probe.load). `check(source,
    tokenizer)` runs before any stack loads, so a file that does not fit the model fails in seconds."""
    from ..engines import torch_state
    from ..environment import resolve_device
    from ..models.source import resolve_model
    from .loading import load_stacks, stack_settings, stack_for
    from .side_settings import train_settings
    from ..versions import check as check_versions, environment

    check_versions(stack_class(infer).libraries if infer else (), spec.allow_untested_versions)  # before any load
    if infer is not None:
        probe = load_stacks(spec=replace(spec, infer=infer), before_stacks=check, taps="none")
        return Scorer.of_probe(probe, prefill=True)
    from transformers import AutoTokenizer

    torch_state.check_sdpa(spec.train_sdpa, resolve_device(spec.device), spec.train_attn)
    source = resolve_model(spec.model)
    settings = stack_settings(spec, source)
    random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    if check is not None:
        check(source, tokenizer)
    train = stack_for(spec.train, settings)  # on --train-device, sharded at --train-tp, as compare's trainer
    train.load(train_settings(spec, settings))
    manifest = {"model": model_section(source),
                "load": {k: getattr(spec, k) for k in ("train", "dtype", "train_attn", "train_sdpa", "train_state",
                                                       "train_device", "train_tp", "seed")} | {"device": settings.device,
                                                                   "max_model_len": settings.max_model_len},
                "stacks": {"train": vars(train.info())}, "environment": environment(settings.device)}
    return Scorer(train, tokenizer, vocab_size(source.config, tokenizer), settings.max_model_len, settings.batch_tokens,
                  manifest)


def score(rollouts: str | Path, model: str | None = None, *, fmt: str = "auto", fields: str | None = None,
          infer: str | None = None, temperature: float | None = None, clip_eps: float | None = None,
          tis_cap: float | None = None, **load) -> ScoreRun:
    """Read a rollout file and score it (see the module docstring). `infer`: None (trainer only) or "vllm" (also
    the engine's prefill). `load`: LoadSpec's training-side settings (dtype, device, train_attn, train_sdpa, ...)."""
    call = ScoreSpec(rollouts=str(Path(rollouts).absolute()), fmt=fmt, fields=fields, infer=infer,
                     temperature=temperature,
                     **{k: v for k, v in (("clip_eps", clip_eps), ("tis_cap", tis_cap)) if v is not None})
    return score_spec(call, LoadSpec(model=model, **load))


def score_spec(call: ScoreSpec, spec: LoadSpec, check=None, progress: Progress | None = None,
               rollouts_sha256: str | None = None, gate: Gate | None = None) -> ScoreRun:
    """score() of a ScoreSpec and its trainer's LoadSpec (what rerun replays). `check(source)` runs once the model is
    resolved and before any stack loads (rerun: is it the recorded checkpoint?); `rollouts_sha256` (rerun: the
    recorded one) is what the bytes read must hash to; `progress` as score_batch's; `gate` (--fail-if, judged by the
    caller) is checked against what a model-free score measures before it scores."""
    batch = read_rollouts(call.rollouts, call.fmt, call.fields)
    if rollouts_sha256 is not None and batch.sha256 != rollouts_sha256:
        raise ProbeError(f"the rollout file {batch.path} changed since the run was made (its sha256 is not the one "
                         "the run folder records); restore it, or score it again with `divergence-probe score`")
    if batch.has_train and spec.model is None and call.infer is None:  # both sides in the file: no model loads
        from .paired import paired_run

        if call.temperature is not None:
            raise ProbeError("--temperature tests the trainer's logits, which a file's logprobs do not hold; pass "
                             "--model to score with the training stack, or drop --temperature")
        if gate:
            gate.check_measured(call, model_free=True)
        run = paired_run(batch, call.clip_eps, call.tis_cap)
        run.manifest["score"] |= {"spec": asdict(call), "load_spec": asdict(spec)}
        return run

    def before_stacks(source, tokenizer):
        if check is not None:
            check(source)
        check_fits(batch, tokenizer, vocab_size(source.config, tokenizer), source.max_model_len,
                   engine=call.infer is not None)

    scorer = load_scorer(spec, call.infer, before_stacks)
    try:
        run = score_batch(scorer, batch, temperature=call.temperature, clip_eps=call.clip_eps, tis_cap=call.tis_cap,
                          progress=progress)
    finally:
        scorer.close()
    run.manifest["score"] |= {"spec": asdict(call), "load_spec": asdict(spec)}
    return run


# ---------------------------------------------------------------------------------------------- score's history mode
def score_steps(files: list[Path], out_dir: Path, call, load, *, alarms: Gate, gate: Gate | None = None,
                draw: Draw | None = None, progress: Progress | None = None) -> History:
    """score's history mode: `call` (a ScoreSpec; its `rollouts` is the first file) and `load` (a LoadSpec) as for
    one file. Model-free when the files hold both logprob columns and no --model or --infer is given; otherwise
    the training stack loads once and scores every step."""
    from .paired import paired_run

    first = read_rollouts(files[0], call.fmt, call.fields)
    model_free = first.has_train and load.model is None and call.infer is None
    if model_free and call.temperature is not None:
        raise ProbeError("--temperature tests the trainer's logits, which a file's logprobs do not hold; pass "
                         "--model to score with the training stack, or drop --temperature")
    for conditions in (alarms, gate):
        if conditions:
            conditions.check_measured(call, model_free)
    scorer = None if model_free else load_scorer(load, call.infer)
    try:
        def score_one(path: Path):
            batch = first if path == files[0] else read_rollouts(path, call.fmt, call.fields)
            if model_free:
                run = paired_run(batch, call.clip_eps, call.tis_cap)
            else:
                run = score_batch(scorer, batch, temperature=call.temperature, clip_eps=call.clip_eps,
                                  tis_cap=call.tis_cap)
            return batch, run.summary

        manifest = {} if scorer is None else {k: v for k, v in scorer.manifest.items() if k != "kind"}
        manifest["score"] = {"spec": asdict(replace(call, rollouts=str(files[0]))), "load_spec": asdict(load),
                             "trainer": "recorded" if model_free else "scored", "prefill": call.infer is not None,
                             "format": first.format, "first_file": str(files[0]), "last_file": str(files[-1]),
                             "n_files": len(files)}
        return write_history(files, out_dir, score_one, alarms=alarms, gate=gate, manifest=manifest, draw=draw,
                             progress=progress)
    finally:
        if scorer is not None:
            scorer.close()
