"""Capture inside vLLM's decode path: map every step's flattened rows to (request, position).

Rollouts run many engine steps (one prefill, then one token per sequence per step), with requests in the
runner's own order. The model runner knows, at each step, which request owns which rows and where each
starts (`input_batch.req_ids`, `query_start_loc`, `num_computed_tokens_cpu`); that layout is read once per
step, here, and every tap and logits row is filed under (request, position). After generation each
sequence's pieces are stitched in position order and checked against the tokens it was actually fed.

Logits come from two kinds of calls: prompt-logprob calls slice the step's final hidden states (their rows
are step rows), while the sampler's call gathers one row per request: the request's last fed position.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ..errors import StackError
from ..taps import TapKey


@dataclass
class _Span:
    req_id: str
    row: int  # first row in the step
    position: int  # position of that row in the sequence
    count: int


class RolloutRecorder:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.steps: list[list[_Span]] = []
        self.step_ids: list[list[int]] = []  # the input ids of each step, to check the stitching
        self.taps: dict[TapKey, list[torch.Tensor]] = defaultdict(list)
        self.logits: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)  # req -> position -> [V]
        self.final_hidden: torch.Tensor | None = None
        self._joined: dict[TapKey, torch.Tensor] = {}

    def begin_step(self, input_ids: torch.Tensor) -> None:
        try:
            batch = self.runner.input_batch
            n = batch.num_reqs
            req_ids = list(batch.req_ids[:n])
            starts = self.runner.query_start_loc.np[: n + 1].tolist()
            computed = batch.num_computed_tokens_cpu[:n].tolist()
        except AttributeError as e:
            raise StackError(
                f"{type(self.runner).__name__} ({type(self.runner).__module__}) exposes no step layout ({e}); "
                "generate mode reads the layout of vLLM's v1 GPUModelRunner (0.32 CPU, 0.24 CUDA for Qwen2); "
                "vLLM 0.24's newer runner (used for Qwen3 on CUDA) is not supported yet"
            ) from e
        self.steps.append([_Span(r, starts[i], int(computed[i]), starts[i + 1] - starts[i]) for i, r in enumerate(req_ids)])
        self.step_ids.append(input_ids.tolist())

    def add_tap(self, key: TapKey, x: torch.Tensor) -> None:
        self.taps[key].append(x.reshape(x.shape[0], -1).clone())

    def add_logits(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        spans, base = self.steps[-1], self.final_hidden
        if base is not None and hidden.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
            # prompt logprobs: rows are step rows; keep scored prompt positions (the sampler owns the last)
            row0 = (hidden.data_ptr() - base.data_ptr()) // (base.stride(0) * base.element_size())
            for span in spans:
                for j in range(max(row0, span.row), min(row0 + len(hidden), span.row + span.count - 1)):
                    self.logits[span.req_id][span.position + j - span.row] = logits[j - row0].clone()
            return
        if len(logits) != len(spans):
            raise StackError(f"vLLM's sampler computed {len(logits)} logits rows for {len(spans)} requests")
        for span, row in zip(spans, logits):  # one row per request: its last fed position
            self.logits[span.req_id][span.position + span.count - 1] = row.clone()

    def _whole(self, key: TapKey) -> torch.Tensor:
        """All steps' rows of one tap, joined once (then shared by every request)."""
        if key not in self._joined:
            whole = torch.cat(self.taps[key])
            if len(whole) != sum(len(ids) for ids in self.step_ids):
                raise StackError(f"tap {key.label} has {len(whole)} rows for {sum(map(len, self.step_ids))} step rows")
            self._joined[key] = whole
        return self._joined[key]

    def _rows(self, req_id: str) -> list[tuple[int, int, int]]:
        """(position, global row, token id) of every row this request was fed, over all steps."""
        out, offset = [], 0
        for spans, ids in zip(self.steps, self.step_ids):
            for span in spans:
                if span.req_id == req_id:
                    out += [(span.position + j, offset + span.row + j, ids[span.row + j]) for j in range(span.count)]
            offset += len(ids)
        return sorted(out)

    def stitch(self, req_id: str, token_ids: tuple[int, ...], seq_id: int, sink) -> torch.Tensor:
        """Emit this request's taps as [L-1, F] tensors and return its [L-1, V] logits (positions 0..L-2)."""
        rows = self._rows(req_id)
        fed = len(token_ids) - 1  # the last sampled token is never fed back
        if [p for p, _, _ in rows] != list(range(fed)) or [t for _, _, t in rows] != list(token_ids[:fed]):
            raise StackError(f"vLLM request {req_id}: the rows it was fed do not spell its sequence; seam moved")
        index = torch.tensor([r for _, r, _ in rows])
        for key in self.taps:
            whole = self._whole(key)
            sink(seq_id, key, whole.index_select(0, index.to(whole.device)))
        by_position = self.logits.get(req_id, {})
        if sorted(by_position) != list(range(fed)):
            raise StackError(f"vLLM request {req_id}: logits missing for some positions; capture seam moved")
        return torch.stack([by_position[p] for p in range(fed)])
