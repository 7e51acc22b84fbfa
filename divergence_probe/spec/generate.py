"""GenerateSpec: prefill scores the prompts; generate samples responses as RL does."""

from __future__ import annotations

from dataclasses import dataclass

from ..engines.protocol import SamplingSpec
from ..errors import ProbeError
from ..options import option
from ..rollouts.formats import EXPORT_FORMATS
from .fields import _choice, check_finite

MODES = ("prefill", "generate")
# Upper bounds of the sampling counts, shared with rl (its group and its responses): each sample is a request held
# with its logits until its batch is paired, so a mistyped count would fill memory before anything failed.
MAX_GROUP_SIZE = 256
MAX_NEW_TOKENS = 32_768


@dataclass(frozen=True, kw_only=True)
class GenerateSpec(SamplingSpec):
    """prefill scores the prompts; generate samples responses through the engine's decode path, as RL does."""

    mode: str = option("prefill", "prefill: score the prompts (vLLM's prompt logprobs); generate: sample responses "
                                  "through vLLM's decode path and compare what RL sees.")
    clip_eps: float = option(0.2, "generate mode: PPO clip band [1-eps, 1+eps] for the ratio metrics.")
    tis_cap: float = option(2.0, "generate mode: TIS truncation cap C (token MIS band [1/C, C]).")
    rollouts_format: str = option("generic", "generate mode: the layout of rollouts.jsonl, the samples with the "
                                             "engine's logprobs that `score` reads back: " + ", ".join(EXPORT_FORMATS)
                                             + " (each framework's own field names).")

    def __post_init__(self) -> None:
        check_finite(self)
        _choice(self.mode, MODES, "--mode")
        _choice(self.rollouts_format, EXPORT_FORMATS, "--rollouts-format")
        checks = [
            (1 <= self.max_new_tokens <= MAX_NEW_TOKENS, f"--max-new-tokens must be from 1 to {MAX_NEW_TOKENS}"),
            (1 <= self.samples_per_prompt <= MAX_GROUP_SIZE, f"--samples-per-prompt must be from 1 to "
                                                             f"{MAX_GROUP_SIZE} (RL recipes sample 4 to 64 responses "
                                                             "per prompt)"),
            (self.temperature >= 0, "--temperature must be >= 0 (0 = greedy)"),
            (0 < self.top_p <= 1, "--top-p must be in (0, 1]"),
            (0 < self.clip_eps < 1, "--clip-eps must be in (0, 1)"),
            (self.tis_cap > 1, "--tis-cap must be > 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ProbeError(message)

    @property
    def generates(self) -> bool:
        return self.mode == "generate"
