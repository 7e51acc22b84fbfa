"""One engine step's token rows mapped back to the prompts of its batch: each prompt's logits at its scored positions
and each tap split into one view per prompt, cloned once for the step where vLLM writes the buffer again."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import StackError
from ...taps import Tap, TapKey

# Taps whose buffer vLLM may write again later in the same forward, so they are cloned when captured (on CUDA the
# fused add+norm is vLLM's C kernel, registered `inplace=True`: it overwrites both its input and the residual):
#   embed           becomes layer 0's residual, which the fused add of post_attention_layernorm overwrites
#   q_norm, k_norm  rotated in place by RoPE right after (Qwen3)
#   attn_out        o_proj's output, normalized in place by post_attention_layernorm
#   resid_mid       the residual, overwritten by the next fused add (next input_layernorm or the final norm)
#   mlp_out         down_proj's output, normalized in place by the next input_layernorm or the final norm
# Every other tap is a buffer no op writes after the hook sees it (a norm's output read by the next projection,
# RoPE's output read by attention, attention's and SiluAndMul's fresh outputs, our own resid_out) and is kept
# as it is: cloning those too was four fifths of the capture's copy traffic (Qwen2.5-1.5B). tests/runs/test_compare.py
# checks the list against cloning every tap on the CPU build, whose fused add+norm is out of place (so there it
# catches q_norm and k_norm); on the H200, CSVs byte-identical to a run that cloned every tap checked it
# (docs/results/h200/README.md).
#   q_proj, k_proj  views of qkv_proj's output, which the CPU RoPE kernel rotates in place (Qwen2)
REWRITTEN = frozenset({"embed", "q_proj", "k_proj", "q_norm", "k_norm", "attn_out", "resid_mid", "mlp_out"})


@dataclass
class _Step:
    """The token rows of one engine step, mapped back to prompts."""

    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # prompt_id -> (first row, length)
    final_hidden: torch.Tensor | None = None  # what compute_logits slices for prompt logprobs
    logits_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # prompt_id -> [T-1, V]
    logits_seen: dict[int, torch.Tensor] = field(default_factory=dict)  # prompt_id -> [T-1] bool

    def add_logits(self, row: int, logits: torch.Tensor) -> None:
        """Logits for step rows [row, row+n): keep those at each prompt's scored positions (0..T-2).

        vLLM 0.32 (CPU) computes them per request, vLLM 0.24 (CUDA) over the whole step; either way each
        position must come out once, or identical every time it does."""
        for prompt_id, (start, length) in self.spans.items():
            lo, hi = max(row, start), min(row + logits.shape[0], start + length - 1)
            if lo >= hi:
                continue
            if prompt_id not in self.logits_rows:
                self.logits_rows[prompt_id] = logits.new_empty(length - 1, logits.shape[1])
                self.logits_seen[prompt_id] = torch.zeros(length - 1, dtype=torch.bool)
            rows, seen = self.logits_rows[prompt_id], self.logits_seen[prompt_id]
            new = logits[lo - row : hi - row]
            if seen[lo - start : hi - start].any() and not torch.equal(rows[lo - start : hi - start], new):
                raise StackError(f"vLLM computed two different logits for prompt {prompt_id}; capture seam moved")
            rows[lo - start : hi - start] = new
            seen[lo - start : hi - start] = True

    def logits(self, prompt_id: int, length: int) -> torch.Tensor:
        """The prompt's [T-1, V] logits; every scored position must have been computed."""
        seen = self.logits_seen.get(prompt_id)
        if seen is None or not bool(seen.all()) or len(seen) != length - 1:
            raise StackError(f"vLLM computed no complete prompt logits for prompt {prompt_id}; capture seam moved")
        return self.logits_rows[prompt_id]

    def split(self, x: torch.Tensor, emit, tap: Tap) -> None:
        """One tap's rows of the whole step ([rows, ...]) -> one [T, features] view per prompt, of one clone for the
        step if vLLM writes the buffer again within the forward (REWRITTEN; one clone per step is one copy kernel, not
        one per prompt). A tuple of taps stacked as [taps, rows, features] (a compiled engine's tap buffers) -> one
        [taps, T, features] view per prompt, not a copy: the buffers are written again only by the engine's next step,
        which is a later call of the stack (a scoring call is one step), and a sink keeps a tap no longer than that
        unless it copies it (base.TapSink)."""
        if not isinstance(tap, TapKey):
            for prompt_id, (start, length) in self.spans.items():
                emit(prompt_id, tap, x[:, start : start + length])
            return
        flat = x.reshape(x.shape[0], -1)
        if tap.name in REWRITTEN:
            flat = flat.clone()
        for prompt_id, (start, length) in self.spans.items():
            emit(prompt_id, tap, flat[start : start + length])
