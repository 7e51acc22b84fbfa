"""The run loop compare and score share: each inference batch, then its sequences on the training stack under one
capture, each sequence's scores made as soon as the trainer has run it. compare's inference side is an engine;
score's is the rollouts a user's RL run recorded (engines/recorded), whose stack declares no logits."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import torch

from ..environment import to_device
from .. import timings
from ..errors import NumericsError, StackError
from .measured import Peaks
from ..numerics.metrics import token_kl
from ..prompts import Prompt, batches
from .scored import TokenScore
from ..engines.protocol import PromptScores, TapSink
from ..taps import TapKey

@dataclass
class ScoredSequence:
    """One token sequence the inference stack ran, and what the training stack must run and score for it.

    `key` files its taps and scores (unique within a run); `fed` is how many of its rows the engine actually
    computed: all of them for a prompt, all but the last for a sampled sequence (the engine never feeds its last
    sample back, so that row has no inference-side taps)."""

    key: int
    prompt: Prompt
    logits: torch.Tensor
    logprobs: torch.Tensor
    prompt_id: int
    fed: int
    sample_id: int | None = None
    n_prompt: int | None = None


class SequenceSource:
    """Where a mode's sequences come from: the inference stack runs a group of prompts and returns sequences."""

    mode = "prefill"

    def batch_tokens(self, probe) -> int:
        return probe.settings.batch_tokens

    def batch_count(self, probe) -> int | None:
        """At most so many sequences per inference batch: what the engine schedules in one step."""
        return probe.infer.capabilities().max_sequences_per_step

    def run(self, probe, group: list[Prompt], taps: frozenset[str], park: TapSink, first_key: int) -> list[ScoredSequence]:
        scores = probe.infer.score(group, taps, park)
        if [s.prompt_id for s in scores] != [p.prompt_id for p in group]:
            raise StackError("the inference stack returned scores out of prompt order")
        return [ScoredSequence(p.prompt_id, p, s.logits, s.logprobs, p.prompt_id, len(p.token_ids))
                for p, s in zip(group, scores)]


class PendingScores:
    """One sequence's token scores, computed on the device and on their way to the host; `read()` waits for them.

    On a GPU every read-back waits for all the work queued before it. Reading a sequence's scores only after the
    next one's forward has been queued lets the device finish this one (and its tap reductions) while the host is
    busy queueing the next, instead of the host idling at every sequence.
    """

    def __init__(self, tokenizer, seq: ScoredSequence, train_logits, train_logprobs) -> None:
        # keep what names the tokens, not the logits: a sequence's tensors must not outlive its own turn
        self.seq, self.tokenizer = replace(seq, logits=None, logprobs=None), tokenizer
        device = seq.logits.device  # the comparison's: the engine's (--train-device: the trainer's side moves here)
        train_logits = train_logits.to(device)
        finite = torch.stack([torch.isfinite(seq.logits).all(), torch.isfinite(train_logits).all()])
        kl = token_kl(seq.logits, train_logits)
        # float64 holds the float32 logprobs exactly, so one transfer carries everything
        values = torch.cat([finite.double(), kl, to_device(seq.logprobs, device).double(),
                            to_device(train_logprobs, device).double()])
        self._host = values.to("cpu", non_blocking=True)  # pinned and asynchronous from a GPU
        self._ready = None
        if values.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def read(self) -> list[TokenScore]:
        if self._ready is not None:
            self._ready.synchronize()
        values = self._host.tolist()
        seq = self.seq
        for side, ok in zip(("inference", "training"), values[:2]):
            if not ok:
                raise NumericsError(
                    f"the {side} stack produced NaN/Inf logits on prompt {seq.prompt_id} ({seq.prompt.source}); "
                    "the weights overflow in this dtype (try --dtype float32) or the checkpoint is broken"
                )
        ids = seq.prompt.token_ids
        n = len(ids) - 1
        kl, infer, train = values[2 : 2 + n], values[2 + n : 2 + 2 * n], values[2 + 2 * n :]
        tokens = self.tokenizer.convert_ids_to_tokens(list(ids[1:]))
        sampled = seq.sample_id is not None
        return [TokenScore(seq.prompt_id, pos + 1, ids[pos + 1], tokens[pos], infer[pos], train[pos], kl[pos],
                           seq.sample_id if sampled else None, pos + 1 >= seq.n_prompt if sampled else None)
                for pos in range(n)]


def score_both(probe, prompts: Sequence[Prompt], source: SequenceSource, infer_taps: frozenset[str],
               train_taps: frozenset[str], capture, collect: Callable[[PendingScores], None],
               peaks: Peaks | None = None,
               make_scores: Callable[[ScoredSequence, PromptScores], object] | None = None) -> list[Prompt]:
    """The run loop: each inference batch, then its sequences on the training stack under one capture; as each is
    done, its taps are finished and its scores queued. `collect` gets every sequence's scores one sequence late
    (PendingScores says why). `capture` files taps (capture.TapPairing, or a benchmark's stand-in with the same
    park/pair/finish_prompt methods). Returns the sequences, as the training stack ran them. `peaks` records the
    device's peak memory of each engine step and of each batch's training and reduction (measured.Peaks).
    `make_scores(sequence, train_scores)` makes a sequence's scores (anything with `read()`); by default PendingScores,
    the token KL over the full distribution, which only an inference stack that hands over logits allows (score's
    recorded rollouts hold logprobs only, and make their own)."""
    if make_scores is None:
        if not probe.infer.capabilities().logits:
            raise StackError(f"the token KL compares both stacks' full distributions, and the inference stack "
                             f"{probe.infer.name} hands over no logits (logprobs only)")
        tokenizer = probe.tokenizer

        def make_scores(seq: ScoredSequence, train: PromptScores) -> PendingScores:
            return PendingScores(tokenizer, seq, train.logits, train.logprobs)
    with _collected_per_batch() as batch_done:
        return _score_both(probe, prompts, source, infer_taps, train_taps, capture, collect, batch_done,
                           peaks or Peaks("cpu"), make_scores)


@contextmanager
def _collected_per_batch() -> Iterator[Callable[[], None]]:
    """Python's automatic garbage collection paused for the run loop, which collects the young generations itself after
    each inference batch (as torchtitan's GarbageCollection does between training steps). The loop makes objects by the
    tens of thousands (views of every tap, vLLM's per-position logprobs), and the collections they trigger would
    otherwise walk them again and again in the middle of a forward; nothing in the loop relies on cycles being freed
    sooner."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield lambda: gc.collect(1)
    finally:
        if enabled:
            gc.enable()


def _score_both(probe, prompts, source, infer_taps, train_taps, capture, collect, batch_done, peaks, make_scores
                ) -> list[Prompt]:
    pending: PendingScores | None = None
    ran: list[Prompt] = []
    for group in batches(prompts, source.batch_tokens(probe), source.batch_count(probe)):
        peaks.start()
        with timings.timed("run.score.infer"):
            sequences = source.run(probe, group, infer_taps, capture.park, len(ran))
        peaks.end("engine_step")
        capture.add_sequences(sequences)  # a grafting capture (runs/graft.py) scores against the inference logits
        fed = {seq.key: seq.fed for seq in sequences}
        trained = 0

        def trimmed(key: int, tap: TapKey, x: torch.Tensor) -> None:  # the rows the engine fed, of a sampled sequence
            capture.pair(key, tap, x[: fed[key]])

        # (a prompt's taps go straight to the capture: this runs for every tap, between two kernels of the forward)
        pair = trimmed if any(seq.fed < len(seq.prompt.token_ids) for seq in sequences) else capture.pair

        def finish(train: PromptScores) -> None:  # each sequence, as soon as the training stack has run it
            nonlocal pending, trained
            seq = sequences[trained]
            if train.prompt_id != seq.key:
                raise StackError("a stack returned scores out of order")
            scores = make_scores(seq, train)
            capture.finish_prompt(seq.key)
            if pending is not None:
                collect(pending)
            pending, trained = scores, trained + 1

        peaks.start()
        with timings.timed("run.score.train"):  # the taps' reduction (run.score.train.reduction) runs inside
            probe.train.score([seq.prompt for seq in sequences], train_taps, pair, on_scored=finish)
        peaks.end("train_and_reduce")
        if trained != len(sequences):
            raise StackError(f"of {len(sequences)} sequences, the training stack scored {trained}")
        ran += [seq.prompt for seq in sequences]
        batch_done()
    if pending is not None:
        collect(pending)
    return ran
