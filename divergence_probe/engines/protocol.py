"""The Stack protocol: what the comparison needs from an inference engine or a training framework.

A stack loads a checkpoint, runs prompts (token ids, never text) and reports, per prompt, the logits and
logprobs of every prompt token after the first, while handing each requested tap to a sink as soon as it
is produced. The comparison pairs the two stacks' taps and reduces them; no stack ever sees the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing the module (the CLI's --help) needs no torch
    import torch

from ..options import option
from ..prompts import Prompt
from ..taps import Tap

TapSink = Callable[[int, Tap, "torch.Tensor"], None]
"""sink(prompt_id, tap, tensor): one tap as [tokens, features], or a tuple of taps stacked as [taps, tokens, features]
(taps.Tap; `taps.each_tap` unstacks). The tensor stays as handed over until the stack's next call (score, sample,
score_batched), so a sink may keep it as it is until then; one that keeps it longer copies it. vLLM clones what it
overwrites within a forward, but a compiled engine hands over views of its tap buffers, which its next step writes
again; transformers writes no activation in place and hands over views."""


ScoresSink = Callable[["PromptScores"], None]


@dataclass(frozen=True, kw_only=True)
class StackSettings:
    """How both stacks are loaded. One object, so the two sides provably get the same dtype and device."""

    model_path: str
    dtype: torch.dtype
    device: str  # "cpu" or "cuda"
    seed: int = 0
    max_model_len: int = 2048
    train_attn: str = "sdpa"  # transformers attention implementation (training side)
    batch_tokens: int = 8192  # most prompt tokens one vLLM step holds; bounds capture memory
    engine: str = "eager"  # vLLM: "eager" (enforce_eager, every module hook fires) or "compiled" (vLLM's defaults)
    engine_args: tuple[tuple[str, object], ...] = ()  # extra vllm.LLM keywords, frozen (`freeze_engine_args`)
    train_sdpa: str = "auto"  # SDPA kernel of the training forward: auto, math, flash, efficient, cudnn
    train_state: str = "isolated"  # torch numerics of the training forward: isolated (pre-vLLM) or inherited
    train_precision: str = "bf16"  # training side: bf16 (weights in `dtype`) or amp (FP32 weights, autocast to dtype)
    train_kernels: str = "torch"  # training side: the kernel set its forward runs (engines/hf/kernels/)
    train_tp: int = 1  # training side: ranks it is sharded over (engines/hf/tensor_parallel.py)
    engine_taps: frozenset[str] = frozenset()  # compiled vLLM: layer taps the engine gets tap points and buffers for
    # (engines/vllm/compiled_taps.py); empty: none, vLLM as deployed

    def engine_kwargs(self) -> dict[str, object]:
        """The engine args as the user gave them (JSON values), for vllm.LLM and the manifest."""
        return {key: _thaw(value) for key, value in self.engine_args}


class _JSONObject(tuple):
    """A JSON object frozen as sorted (key, value) pairs: hashable, and thawed back into a dict, not a list."""


def _freeze(value):
    if isinstance(value, dict):
        return _JSONObject(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value):
    if isinstance(value, _JSONObject):
        return {k: _thaw(v) for k, v in value}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def freeze_engine_args(args: dict[str, object]) -> tuple[tuple[str, object], ...]:
    """{"compilation_config": {"mode": 3}, ...} -> sorted, hashable pairs for StackSettings.engine_args (settings
    are compared and hashed: one engine per process is kept per settings)."""
    return tuple(sorted((str(k), _freeze(v)) for k, v in args.items()))


@dataclass
class PromptScores:
    """One prompt's scores from one stack, for scored positions 1..T-1 (the token each logit row predicts).

    logits: [T-1, V] in the stack's own output dtype (kept, not upcast, so the KL sees what the stack made).
    logprobs: [T-1] float32, the logprob of the actual next token as the stack itself reports it.
    """

    prompt_id: int
    logits: torch.Tensor
    logprobs: torch.Tensor


@dataclass
class StackInfo:
    """What ran, for the manifest: versions, device, and the implementation each region dispatched to."""

    name: str
    versions: dict[str, str] = field(default_factory=dict)
    implementations: dict[str, str] = field(default_factory=dict)
    settings: dict[str, object] = field(default_factory=dict)


class Stack(Protocol):
    name: str

    def load(self, settings: StackSettings) -> None: ...

    def score(self, prompts: Sequence[Prompt], taps: frozenset[str], sink: TapSink,
              on_scored: "ScoresSink | None" = None) -> list[PromptScores]:
        """Run the prompts (as one batch where the stack batches) and return their scores in prompt order.

        With `on_scored`, each prompt's scores go to it as soon as they are final, in prompt order, while the
        capture is still installed, and the returned list is empty: the caller can finish a prompt (pair and reduce
        its taps, drop its logits) before the next one runs, and the stack installs its hooks once per call rather
        than once per prompt."""
        ...

    def score_batched(self, prompts: Sequence[Prompt], taps: frozenset[str] = frozenset(),
                      sink: TapSink | None = None) -> list[PromptScores]:
        """The same scores with the prompts batched as the stack batches them (the batch-invariance noise floor); a
        stack may capture some taps there (a router's logits, for the routing floor) or none."""
        ...

    def sample(self, prompts: Sequence[Prompt], spec: "SamplingSpec", taps: frozenset[str], sink: TapSink) -> list["SequenceScores"]:
        """Sample responses as a rollout does and score prompt+response; taps keyed by sequence id."""
        ...

    def info(self) -> StackInfo: ...

    # Optional, for stacks that need them (the run loop and the region patcher look for them):
    #   max_sequences_per_step: int   the most sequences one batch may hold (an engine's scheduler limit)
    #   tap_status() -> {tap: "captured" or why not}   taps this stack cannot capture (e.g. inside a compiled graph)
    #   check_patchable() -> None     raise when a region patch would not take effect (a compiled engine)

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """How the inference stack samples rollouts (generate mode)."""

    max_new_tokens: int = option(64, "generate mode: most tokens sampled per response.")
    samples_per_prompt: int = option(1, "generate mode: responses sampled per prompt.")
    temperature: float = option(1.0, "generate mode: sampling temperature (0 = greedy). Compared logprobs stay raw "
                                     "(untempered).")
    top_p: float = option(1.0, "generate mode: nucleus sampling.")
    seed: int = option(0, "the run's seed (--seed)", cli=False)

    def request_seed(self, prompt_id: int, sample: int) -> int:
        """One seed per (prompt, sample): reproducible, and independent of how requests are batched."""
        return self.seed * 1_000_003 + prompt_id * 1009 + sample


@dataclass
class SequenceScores:
    """One sampled sequence (prompt + response) as the inference stack produced and scored it.

    token_ids: prompt then response; positions 1..L-1 are scored. logits: [L-1, V] in the stack's dtype.
    logprobs: [L-1] float32 as the stack reports them (prompt part: prompt logprobs; response part: the raw
    logprob of each sampled token). seq_id keys this sequence's taps.
    """

    seq_id: int
    prompt_id: int
    sample_id: int
    token_ids: tuple[int, ...]
    n_prompt: int
    logits: torch.Tensor
    logprobs: torch.Tensor
