"""compare: feed both stacks the same token ids and diff every tap and every token's logprob.

The loop: an inference batch runs first and parks its taps; then the training stack runs the batch's prompts one
by one, and as each is done its taps are paired and reduced (capture.py) and its logits scored against the
inference logits at every prompt position. Nothing per-layer outlives its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

import torch

from .batch_invariance import measure as measure_batch_invariance
from .capture import TapPairing
from .environment import to_device
from .errors import NumericsError, ProbeError, StackError
from .fused import backend as fused_backend
from .metrics import DiffStats, token_kl
from .prompts import Prompt, file_hashes, load_prompts, default_prompts_path
from .tables import layers_frame, summary_row, tokens_frame
from .stacks.base import PromptScores
from .taps import TapKey, expected_taps, parse_tap_selection

Progress = Callable[[int, int], None]  # (prompts done, prompts total)


@dataclass(frozen=True, kw_only=True)
class CompareOptions:
    """Which prompts to score and what to capture."""

    prompts: str | Path | None = None
    """A .txt/.jsonl file or a folder of them; None = the shipped sample_prompts/."""
    num_prompts: int | None = None
    max_prompt_tokens: int | None = None
    """Truncate longer prompts to this many tokens (otherwise a prompt beyond the context is an error)."""
    taps: str = "all"
    """all, none, or a comma list of canonical tap names."""
    threshold: float = 1e-3
    """rel_l2 above which a tap counts as diverged (first_over_threshold)."""
    batch_invariance: bool = False
    """Also measure each stack's own batch-1-vs-batched difference (batch_invariance.csv)."""
    progress: Progress | None = None

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise ProbeError("--threshold must be a non-negative number")
        parse_tap_selection(self.taps)  # fail on a typo before anything is loaded


@dataclass
class TokenScore:
    """One scored prompt token: both logprobs of the actual token and the full-vocabulary KL."""

    prompt_id: int
    position: int
    token_id: int
    token: str
    logprob_infer: float
    logprob_train: float
    kl: float


@dataclass
class CompareRun:
    """The result of one comparison; `write` puts it on disk as CSVs and a manifest."""

    prompts: list[Prompt]
    tokens: list[TokenScore]
    tap_stats: dict[TapKey, DiffStats]
    threshold: float
    manifest: dict = field(default_factory=dict)
    batch_invariance: "pd.DataFrame | None" = None

    @property
    def tokens_table(self):
        return tokens_frame(self.tokens)

    @property
    def layers_table(self):
        return layers_frame(self.tap_stats)

    @property
    def summary(self) -> dict:
        return summary_row(self.tokens, self.tap_stats, self.threshold) | noise_floor_columns(self.batch_invariance)

    def write(self, out_dir: str | Path) -> Path:
        from .rundir import write_compare_run

        return write_compare_run(self, Path(out_dir))


def batches(prompts: Sequence[Prompt], max_tokens: int) -> Iterator[list[Prompt]]:
    """Consecutive groups whose total length fits max_tokens (a longer prompt goes alone)."""
    group, size = [], 0
    for prompt in prompts:
        if group and size + len(prompt.token_ids) > max_tokens:
            yield group
            group, size = [], 0
        group.append(prompt)
        size += len(prompt.token_ids)
    if group:
        yield group


class PendingScores:
    """One prompt's token scores, computed on the device and on their way to the host; `read()` waits for them.

    On a GPU every read-back waits for all the work queued before it. Reading a prompt's scores only after the
    next prompt's forward has been queued lets the device finish this prompt (and its tap reductions) while the
    host is busy queueing the next one, instead of the host idling at every prompt.
    """

    def __init__(self, probe, prompt: Prompt, infer_logits, infer_logprobs, train_logits, train_logprobs) -> None:
        self.prompt, self.tokenizer = prompt, probe.tokenizer
        device = infer_logits.device
        finite = torch.stack([torch.isfinite(infer_logits).all(), torch.isfinite(train_logits).all()])
        kl = token_kl(infer_logits, train_logits.to(device))
        # float64 holds the float32 logprobs exactly, so one transfer carries everything
        values = torch.cat([finite.double(), kl, to_device(infer_logprobs, device).double(),
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
        for side, ok in zip(("inference", "training"), values[:2]):
            if not ok:
                raise NumericsError(
                    f"the {side} stack produced NaN/Inf logits on prompt {self.prompt.prompt_id} ({self.prompt.source}); "
                    "the weights overflow in this dtype (try --dtype float32) or the checkpoint is broken"
                )
        ids = self.prompt.token_ids
        n = len(ids) - 1
        kl, infer, train = values[2 : 2 + n], values[2 + n : 2 + 2 * n], values[2 + 2 * n :]
        tokens = self.tokenizer.convert_ids_to_tokens(list(ids[1:]))
        return [TokenScore(self.prompt.prompt_id, pos + 1, ids[pos + 1], tokens[pos], infer[pos], train[pos], kl[pos])
                for pos in range(n)]


def score_prompt(probe, prompt: Prompt, infer_logits, infer_logprobs, train_logits, train_logprobs) -> list[TokenScore]:
    """Both logprobs of every scored token and the full-vocabulary KL, on the host (waits for the device)."""
    return PendingScores(probe, prompt, infer_logits, infer_logprobs, train_logits, train_logprobs).read()


def run_manifest(probe, mode: str, prompts_path: Path, prompts, options: CompareOptions, taps) -> dict:
    """The probe's manifest plus what this run scored and captured."""
    manifest = probe.manifest()
    manifest["compare"] = {
        "mode": mode,
        "prompts": str(prompts_path),
        "prompt_files_sha256": file_hashes(prompts_path),
        "num_prompts": len(prompts),
        "max_prompt_tokens": options.max_prompt_tokens,
        "taps": sorted(taps),
        "threshold": options.threshold,
        "batch_invariance": options.batch_invariance,
        "tap_reduction": fused_backend() if taps else None,
    }
    return manifest


def noise_floor_columns(floor) -> dict:
    """Each stack's own batch-1-vs-batched mean |Δlogp|, for the summary beside the mismatch (if measured)."""
    if floor is None:
        return {}
    return {f"noise_{r.side}_mean_abs_dlogp": r.mean_abs_dlogp for r in floor.itertuples()}


class TapCapture(Protocol):
    """Where the compare loop files taps: capture.TapPairing, or a benchmark's stand-in that drops them."""

    def park(self, prompt_id: int, key: TapKey, tensor: torch.Tensor) -> None: ...

    def pair(self, prompt_id: int, key: TapKey, tensor: torch.Tensor) -> None: ...

    def finish_prompt(self, prompt_id: int) -> None: ...


def score_both(probe, prompts: Sequence[Prompt], infer_taps: frozenset[str], train_taps: frozenset[str],
               capture: TapCapture, collect: Callable[[PendingScores], None]) -> None:
    """The compare loop: each inference batch, then its prompts one by one on the training stack; as each is
    done, its taps are finished and its scores queued. `collect` gets every prompt's scores one prompt late
    (PendingScores says why)."""
    pending: PendingScores | None = None
    for group in batches(prompts, probe.settings.batch_tokens):
        infer_scores = probe.infer.score(group, infer_taps, capture.park)
        trained = 0

        def finish(train: PromptScores) -> None:  # each prompt, as soon as the training stack has run it
            nonlocal pending, trained
            prompt, infer = group[trained], infer_scores[trained]
            if infer.prompt_id != prompt.prompt_id or train.prompt_id != prompt.prompt_id:
                raise StackError("a stack returned scores out of prompt order")
            scores = PendingScores(probe, prompt, infer.logits, infer.logprobs, train.logits, train.logprobs)
            capture.finish_prompt(prompt.prompt_id)
            if pending is not None:
                collect(pending)
            pending, trained = scores, trained + 1

        probe.train.score(group, train_taps, capture.pair, on_scored=finish)
        if not len(infer_scores) == trained == len(group):
            raise StackError(f"of {len(group)} prompts, the inference stack scored {len(infer_scores)} and the "
                             f"training stack {trained}")
    if pending is not None:
        collect(pending)


def run_compare(probe, options: CompareOptions) -> CompareRun:
    prompts_path = Path(options.prompts) if options.prompts is not None else default_prompts_path()
    prompts = load_prompts(
        prompts_path,
        probe.tokenizer,
        num_prompts=options.num_prompts,
        max_prompt_tokens=options.max_prompt_tokens,
        max_model_len=probe.settings.max_model_len,
    )
    taps = parse_tap_selection(options.taps)
    pairing = TapPairing(expected_taps(taps, probe.source.num_layers, probe.source.has_qk_norm))
    tokens: list[TokenScore] = []
    done = 0

    def collect(scores: PendingScores) -> None:
        nonlocal done
        tokens.extend(scores.read())
        done += 1
        if options.progress:
            options.progress(done, len(prompts))

    score_both(probe, prompts, taps, taps, pairing, collect)
    manifest = run_manifest(probe, "prefill", prompts_path, prompts, options, taps)
    floor = measure_batch_invariance(probe, prompts) if options.batch_invariance else None
    return CompareRun(prompts, tokens, pairing.stats, options.threshold, manifest, floor)
