"""A prompt as every stack receives it: token ids, tokenized once (prompts.py reads and tokenizes the files).

Imports nothing, so that the stacks' protocol, which takes these, sits no deeper in the import graph for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """A tokenized prompt, the same for every stack."""

    prompt_id: int                # 0..n-1 in load order
    source: str                   # "code.txt:3"
    text: str                     # as given; for chat prompts the rendered template string
    token_ids: tuple[int, ...]    # what is scored (after truncation, if any)
    truncated: bool = False       # token_ids were cut to --max-prompt-tokens; text was not
