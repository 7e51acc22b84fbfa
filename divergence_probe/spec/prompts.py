"""PromptSpec: which prompts are scored."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ProbeError
from ..options import option
from ..prompts import check_kind, default_prompts_path


@dataclass(frozen=True, kw_only=True)
class PromptSpec:
    """Which prompts are scored."""

    prompts: str | None = option(None, ".txt (blank-line or --- separated), .jsonl (prompt or chat messages), or a "
                                       "folder of them. Default: the packaged sample prompts (divergence_probe/data/sample_prompts/).", short="-p")
    num_prompts: int | None = option(None, "Use only the first N prompts.", short="-n")
    max_prompt_tokens: int | None = option(None, "Truncate prompts to N tokens (otherwise a prompt longer than the "
                                                 "context is an error).")

    def __post_init__(self) -> None:
        if self.prompts is not None:
            object.__setattr__(self, "prompts", str(self.prompts))
            check_kind(Path(self.prompts))
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ProbeError(f"--num-prompts must be at least 1, got {self.num_prompts}.")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 2:
            raise ProbeError(f"--max-prompt-tokens must be at least 2 (every token after the first is scored), "
                             f"got {self.max_prompt_tokens}.")

    @property
    def path(self) -> Path:
        """The prompt files a run reads: --prompts, or the packaged sample prompts."""
        return Path(self.prompts) if self.prompts is not None else default_prompts_path()
