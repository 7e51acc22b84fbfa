"""The noise floor: how much one stack moves its own logprobs when the same sequences run alone vs batched, and
how much the training stack moves them under another attention kernel, and how much vLLM moves them in its other
engine mode (eager vs compiled).

A stack's own batch composition can move its logprobs as much as the vLLM-vs-transformers gap
(docs/results/h200/README.md), so a mismatch number means little without this floor beside it.
Each stack scores the same token sequences twice, with no taps: one sequence per call, then batched (vLLM: engine
steps of at most --batch-tokens tokens; transformers: right-padded micro-batches of at most --batch-tokens padded
tokens, with an attention mask). A trainer's
attention kernel is a choice torch makes per process and machine (cuDNN, flash, efficient, math), so the training
stack also scores the sequences under another SDPA kernel (`kernel_noise`). Compiling changes an engine's numerics
(Inductor fuses and keeps intermediates in FP32; by how much: docs/results/h200/), so `engine_noise` scores
the sequences on a second engine in the other mode, with the same regions aligned: every compiled-mode mismatch
then stands beside the engine's own eager-vs-compiled gap.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch

from ..engines import stack_class
from ..numerics.metrics import token_kl
from ..numerics.tables import HEADLINE, headline
from ..prompts import Prompt

COLUMNS = ["stack", "side", *HEADLINE, "n_tokens", "batch_size"]
KERNEL_COLUMNS = ["stack", "side", "change", *HEADLINE, "n_tokens"]


def _ignore(*_) -> None:
    pass


def measure(probe, sequences: Sequence[Prompt]) -> pd.DataFrame:
    """One batch at a time, each sequence of it then alone: what is held is one batch's scores (a trainer's
    micro-batch of padded logits), as the memory plan counts it, not every batch's at once."""
    rows, sums = [], []
    for side, stack in (("infer", probe.infer), ("train", probe.train)):
        row, keys, deltas = measure_side(side, stack, sequences)
        rows.append(row)
        sums.append(_sequence_sums(len(rows) - 1, keys, deltas))
    return _with_sums(pd.DataFrame(rows, columns=COLUMNS), sums)


# A floor table's attrs key: each row's |Δlogp| summed per sequence, records (row, sequence, n, sum_abs_dlogp), so that
# the noise verdict resamples the floor's prompts with the mismatch's (numerics/noise_verdict.py). Not written: the
# CSVs hold the means. Plain tuples, not a DataFrame: pandas compares attrs when it concatenates tables, and a
# DataFrame has no truth value.
PER_SEQUENCE = "per_sequence"
SUM_COLUMNS = ["row", "sequence", "n", "sum_abs_dlogp"]


def _sequence_sums(row: int, keys: Sequence[int], deltas: Sequence[np.ndarray]) -> tuple:
    return tuple((row, int(key), int(d.size), float(d.sum())) for key, d in zip(keys, deltas))


def _with_sums(table: pd.DataFrame, sums: Sequence[tuple]) -> pd.DataFrame:
    table.attrs[PER_SEQUENCE] = tuple(record for part in sums for record in part)
    return table


def concat_floors(tables: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Floor tables one after the other, with their per-sequence sums (PER_SEQUENCE) renumbered to match."""
    sums, at = [], 0
    for table in tables:
        sums.append(tuple((row + at, *rest) for row, *rest in table.attrs.get(PER_SEQUENCE, ())))
        at += len(table)
    return _with_sums(pd.concat(tables, ignore_index=True), sums)


def sequence_sums(table: pd.DataFrame, row: int) -> pd.DataFrame:
    """Row `row` of a floor table, per sequence: columns sequence, n, sum_abs_dlogp (empty when not recorded)."""
    records = [r for r in table.attrs.get(PER_SEQUENCE, ()) if r[0] == row]
    return pd.DataFrame(records, columns=SUM_COLUMNS)[SUM_COLUMNS[1:]]


def measure_side(side: str, stack, sequences: Sequence[Prompt]) -> tuple[dict, list[int], list[np.ndarray]]:
    """One stack's batch_invariance.csv row, and each sequence's key and |Δlogp| (the floor's per-prompt sums); an
    engine pass of --placement alternate runs the engine's alone."""
    deltas, kls, keys = [], [], []
    groups = stack.batch_groups(sequences)
    for group in groups:
        together = {s.prompt_id: s for s in stack.score_batched(group)}
        for seq in group:
            keys.append(seq.prompt_id)
            [alone] = stack.score([seq], frozenset(), _ignore)
            batched = together[seq.prompt_id]
            deltas.append((batched.logprobs.double().cpu() - alone.logprobs.double().cpu()).abs().numpy())
            kls.append(token_kl(alone.logits, batched.logits.to(alone.logits.device)).cpu().numpy())
        del together
    d, k = np.concatenate(deltas), np.concatenate(kls)
    # the largest batch score_batched ran: an engine step (at most --batch-tokens tokens and max_num_seqs
    # sequences), a trainer's micro-batch (at most --batch-tokens padded tokens)
    size = max(map(len, groups))
    return {"stack": stack.name, "side": side, **headline(d, k), "n_tokens": int(d.size), "batch_size": size}, \
        keys, deltas


ROUTING_NOISE_COLUMNS = ["stack", "side", "change", "layer", "tokens", "frac_experts_differ",
                         "frac_differ_strict_order", "frac_differ_tie_collision", "frac_topk_set_differs",
                         "frac_topk_order_differs", "frac_flipped_near_tie", "frac_tokens_any_flip"]


def routing_noise(probe, sequences: Sequence[Prompt], top_k: int) -> pd.DataFrame:
    """Each stack's routing against itself (a mixture-of-experts model): the same sequences batched (as `measure`
    batches them) vs one per call, compared as the two stacks' routing is (numerics/routing.py): the experts its router
    returned (frac_experts_differ, frac_tokens_any_flip) and, as the explanation, its router logits. One row per stack
    and layer. A batch change moves router logits in the last bits, and near-tied top-k picks flip: the cross-stack
    flip rate means little without this beside it. frac_tokens_any_flip: the share of positions run through other
    experts in at least one layer (the same in every row of a stack and change; NaN where the stack hands over no
    expert ids)."""
    rows = []
    for side, stack in (("infer", probe.infer), ("train", probe.train)):
        alone, together = routing_taps(stack, sequences)
        rows += _routing_rows(stack.name, side, "batched vs alone", together, alone, sequences, top_k)
    return pd.DataFrame(rows, columns=ROUTING_NOISE_COLUMNS)


def routing_taps(stack, sequences: Sequence[Prompt]) -> tuple["_KeptTaps", "_KeptTaps"]:
    """One stack's router taps of every sequence alone, then batched (what routing_noise compares)."""
    alone, together = _KeptTaps(), _KeptTaps()
    for seq in sequences:
        stack.score([seq], ROUTER_TAPS, alone)
    stack.score_batched(sequences, ROUTER_TAPS, together)
    return alone, together


ROUTER_TAPS = frozenset({"router_logits", "expert_ids"})  # the logits and the experts the router returned


def _routing_rows(stack: str, side: str, change: str, changed: "_KeptTaps", base: "_KeptTaps",
                  sequences: Sequence[Prompt], top_k: int) -> list[dict]:
    """One routing_noise.csv row per layer: `changed`'s expert ids and router logits against `base`'s (numerics/routing.py)."""
    from ..numerics import routing

    layers = sorted(base.layers("router_logits"))
    recorded = base.layers("expert_ids") == changed.layers("expert_ids") == set(layers)
    per_layer = [routing.compare_layer(changed.rows("router_logits", layer, sequences),
                                       base.rows("router_logits", layer, sequences), top_k,
                                       infer_ids=changed.rows("expert_ids", layer, sequences) if recorded else None,
                                       train_ids=base.rows("expert_ids", layer, sequences) if recorded else None)
                 for layer in layers]
    any_flip = routing.frac_tokens_any_flip(routing.token_flips(per_layer)[0]) if recorded else float("nan")
    rows = []
    for layer, r in zip(layers, per_layer):
        m = routing.layer_metrics(r)
        rows.append({"stack": stack, "side": side, "change": change, "layer": layer,
                     **{c: m[c] for c in ROUTING_NOISE_COLUMNS[4:-1]}, "frac_tokens_any_flip": any_flip})
    return rows


class _KeptTaps:
    """A tap sink that keeps a copy of each prompt's router logits and expert ids (a stack's taps are valid only until
    its next call), on the host."""

    def __init__(self) -> None:
        self._taps: dict[tuple[str, int, int], torch.Tensor] = {}

    def __call__(self, prompt_id: int, key, x: torch.Tensor) -> None:
        self._taps[(key.name, key.layer, prompt_id)] = x.detach().to("cpu", copy=True)

    def layers(self, name: str) -> set[int]:
        return {layer for tap, layer, _ in self._taps if tap == name}

    def rows(self, name: str, layer: int, sequences: Sequence[Prompt]) -> torch.Tensor:
        return torch.cat([self._taps[(name, layer, seq.prompt_id)] for seq in sequences])


def _against(probe, variant, sequences: Sequence[Prompt], taps: frozenset[str] = frozenset(), mine_taps=_ignore,
             theirs_taps=_ignore) -> tuple[list, list]:
    """The run's trainer and `variant`'s (a probe beside it, closed here) on each sequence alone: per sequence
    |Δlogprob| (variant − run) and the token KL."""
    deltas, kls = [], []
    try:
        for seq in sequences:
            [mine] = probe.train.score([seq], taps, mine_taps)
            [theirs] = variant.train.score([seq], taps, theirs_taps)
            deltas.append((theirs.logprobs.double().cpu() - mine.logprobs.double().cpu()).abs().numpy())
            kls.append(token_kl(mine.logits, theirs.logits.to(mine.logits.device)).cpu().numpy())
    finally:
        variant.close()
    return deltas, kls


def kernel_noise(probe, sequences: Sequence[Prompt], top_k: int | None = None
                 ) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """The training stack against itself with another SDPA kernel (math, or torch's own choice when math is the
    configured one), each sequence alone: (its kernel_noise.csv row, and with `top_k` (a mixture of experts) its
    routing_noise.csv rows: how often the kernel change alone flips the trainer's routes, the trainer's kernel floor
    for routing); (None, None) when the training side has no SDPA kernel to switch."""
    config = probe.config
    if not stack_class(config.train).sdpa or config.train_attn != "sdpa":
        return None, None
    other = "math" if config.train_sdpa != "math" else "auto"
    change = f"sdpa {other} vs {config.train_sdpa}"
    taps = ROUTER_TAPS if top_k else frozenset()
    mine_taps, theirs_taps = (_KeptTaps(), _KeptTaps()) if top_k else (_ignore, _ignore)
    deltas, kls = _against(probe, probe.with_trainer(train_sdpa=other), sequences, taps, mine_taps, theirs_taps)
    routes = None
    if top_k:
        routes = pd.DataFrame(_routing_rows(probe.train.name, "train", change, theirs_taps, mine_taps, sequences, top_k),
                              columns=ROUTING_NOISE_COLUMNS)
    return _change_row(probe.train.name, "train", change, deltas, kls, sequences), routes


TRAIN_TENSOR_PARALLEL_CHANGE = "train_tp"  # "train_tp 1 vs N": the trainer unsharded vs this run's sharded one


def train_parallel_noise(probe, sequences: Sequence[Prompt]) -> pd.DataFrame | None:
    """The trainer's parallelism floor (--train-tp N > 1): the sharded trainer against the same trainer unsharded,
    loaded in this process on its device, each sequence alone, no taps (kernel_noise.csv's row `train_tp 1 vs N`).
    A row-parallel GEMM's output is the sum of N partial products each rounded to the dtype, so sharding alone moves
    the trainer's logprobs; a sharded trainer's mismatch means little without this beside it, as the engine's TP floor
    (engine_noise) does for the engine. None at --train-tp 1."""
    ranks = probe.config.train_tp
    if ranks <= 1:
        return None
    deltas, kls = _against(probe, probe.with_trainer(train_tp=1), sequences)
    return _change_row(probe.train.name, "train", f"{TRAIN_TENSOR_PARALLEL_CHANGE} 1 vs {ranks}", deltas, kls,
                       sequences)


class NoiseEngines:
    """The engines in the other mode that one run's engine noise floors score on, each built once and closed with
    the run. An eager engine takes regions in place, call by call, as the tool's own eager engine does, so one eager
    build serves every combination of an ablation; a compiled engine has its regions built in: one per region set.
    `infer`: the registry name of the run's inference stack, whose worker variant they are."""

    def __init__(self, infer: str) -> None:
        self._class = stack_class(infer)
        self._workers: dict = {}

    def score(self, settings, regions: Sequence[str], sequences: Sequence[Prompt]) -> list:
        built = () if settings.engine == "eager" else tuple(regions)
        key = (settings, built)
        if key not in self._workers:
            # kept first: close() covers a failed start
            self._workers[key] = worker = self._class.for_settings(settings, built)
            worker.load(settings)
        worker = self._workers[key]
        worker.patched = tuple(regions) if not built else ()  # an eager engine takes this call's regions in place
        return worker.score_batched(sequences)

    def __len__(self) -> int:
        """How many engines were built."""
        return len(self._workers)

    def close(self) -> None:
        workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.close()

    def __enter__(self) -> "NoiseEngines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def engine_noise(probe, sequences: Sequence[Prompt], regions: Sequence[str] = (),
                 engines: NoiseEngines | None = None) -> pd.DataFrame:
    """vLLM against itself in the other engine mode, with the same engine-side `regions` aligned, in a worker
    process: both engines score the sequences batched as compare runs them, with no taps. An engine at
    tensor_parallel_size N > 1 is scored against the same engine at 1 instead (the parallelism floor: a TP change
    alone moves logprobs by about the whole engine-vs-trainer gap, docs/numerics.md). A compiled engine built
    with tap points is also scored against the same engine built without them (row `tap points vs none`): the tap
    points are meant to leave the graph's numerics alone, which depends on Inductor's fusions for this model and
    these shapes, so it is measured here rather than assumed. `engines`: shared by the runs of an ablation (closed
    by its owner); else built for this call alone."""
    if engines is None:
        with NoiseEngines(probe.config.infer) as own:
            return engine_noise(probe, sequences, regions, own)
    infer = stack_class(probe.config.infer)
    aligned = f" ({'+'.join(regions)} aligned in both)" if regions else ""
    ranks = infer.ranks(probe.settings.engine_kwargs())
    if ranks > 1:  # the parallelism floor; the other engine mode is not built at tensor_parallel_size > 1
        return _engine_row(probe, sequences, infer.unsharded(probe.settings), regions,
                           f"{TENSOR_PARALLEL_CHANGE} 1 vs {ranks}{aligned}", engines)
    other = infer.other_mode(probe.settings)
    rows = [_engine_row(probe, sequences, other, regions, f"engine {other.engine} vs {probe.settings.engine}{aligned}",
                        engines)]
    if probe.settings.engine == "compiled" and probe.settings.engine_taps:
        from dataclasses import replace

        rows.append(_engine_row(probe, sequences, replace(probe.settings, engine_taps=frozenset()), regions,
                                f"{TAP_POINTS_CHANGE}{aligned}", engines))
    return concat_floors(rows)


TAP_POINTS_CHANGE = "compiled engine without tap points vs with"
TENSOR_PARALLEL_CHANGE = "tensor_parallel_size"  # "tensor_parallel_size 1 vs N": the engine unsharded vs this run's


def _engine_row(probe, sequences: Sequence[Prompt], other, regions: Sequence[str], change: str,
                engines: NoiseEngines) -> pd.DataFrame:
    """This run's engine against one with `other` settings in a worker process: the same sequences, batched as
    compare runs them, no taps."""
    mine = {s.prompt_id: s for s in probe.infer.score_batched(sequences)}
    theirs = {s.prompt_id: s for s in engines.score(other, regions, sequences)}
    deltas, kls = [], []
    for seq in sequences:
        a, b = mine[seq.prompt_id], theirs[seq.prompt_id]
        deltas.append((b.logprobs.double().cpu() - a.logprobs.double().cpu()).abs().numpy())
        kls.append(token_kl(a.logits, b.logits.to(a.logits.device)).cpu().numpy())
    return _change_row(probe.infer.name, "infer", change, deltas, kls, sequences)


def _change_row(stack: str, side: str, change: str, deltas: list, kls: list, sequences: Sequence[Prompt]
                ) -> pd.DataFrame:
    """One stack against itself under one change: the row kernel_noise.csv / engine_noise.csv hold (`deltas`: one
    array per sequence, in the order of `sequences`)."""
    d, k = np.concatenate(deltas), np.concatenate(kls)
    table = pd.DataFrame([{"stack": stack, "side": side, "change": change, **headline(d, k), "n_tokens": int(d.size)}],
                         columns=KERNEL_COLUMNS)
    return _with_sums(table, [_sequence_sums(0, [seq.prompt_id for seq in sequences], deltas)])
