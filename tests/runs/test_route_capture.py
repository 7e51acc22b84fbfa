"""route_capture: a batch's routing compared on stacks of every layer of every sequence (one read-back per inference
batch) equals numerics/routing.py's per-layer calls bit for bit, in calls of any size; its ops do not grow with the sequences
or layers of a batch; and a failing check still names the first sequence, layer and token. Synthetic router logits
on a coarse BF16 grid (ties and one-ULP near-ties everywhere), no model: this file runs in about a second."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from torch.overrides import TorchFunctionMode

from divergence_probe.runs import route_capture
from divergence_probe.numerics import routing
from divergence_probe.errors import NumericsError
from divergence_probe.runs.route_capture import RouteCapture, RouteRecordError
from divergence_probe.taps import TapKey

EXPERTS, TOP_K = 8, 3


@dataclass(frozen=True)
class _Seq:  # what RouteCapture reads of compare.ScoredSequence
    key: int
    prompt_id: int
    sample_id: int | None = None


class _NoPairing:
    """The inner tap capture, doing nothing: only the routing capture's own work is measured."""

    def park(self, *_):
        pass

    def pair(self, *_):
        pass

    def finish_prompt(self, _):
        pass


def _logits(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine's and a trainer's router logits: multiples of 1/8 (exact ties), the trainer's nudged by a BF16 ULP
    here and there (near ties), or redrawn (flips)."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randint(-8, 9, (rows, EXPERTS), generator=g) / 8).to(torch.bfloat16)
    nudged = (a.view(torch.int16) + torch.randint(0, 2, a.shape, generator=g, dtype=torch.int16)).view(torch.bfloat16)
    redrawn = (torch.randint(-8, 9, (rows, EXPERTS), generator=g) / 8).to(torch.bfloat16)
    return a, torch.where(torch.rand(rows, 1, generator=g) < 0.3, redrawn, nudged)


def _run(lengths: list[int], layers: int, batches: list[list[int]] | None, bad=None, train_ids: bool = True
         ) -> tuple[RouteCapture, dict]:
    """Every sequence through a RouteCapture as the run loop drives it: park the engine's taps and routes, pair the
    trainer's (its router's ids too, unless not `train_ids`), finish; both routers break ties by ascending id, as
    both stacks do; `batches`: the keys the run loop names per inference batch (None: never named). `bad`:
    (key, layer, row) whose engine route is not a top-k of its logits."""
    capture = RouteCapture(_NoPairing(), num_layers=layers, top_k=TOP_K, metrics=True, records=True)
    taps = {}
    for batch in batches or [list(range(len(lengths)))]:
        if batches is not None:
            capture.add_sequences([_Seq(key, prompt_id=key) for key in batch])
        for key in batch:
            for layer in range(layers):
                a, b = taps[(key, layer)] = _logits(lengths[key], seed=100 * key + layer)
                ids = routing.topk_ids(a, TOP_K)
                if bad is not None and bad[:2] == (key, layer):
                    ids = ids.clone()
                    ids[bad[2]] = ids[bad[2], 0]  # one expert k times: no top-k of anything
                capture.park(key, TapKey.of("router_logits", layer), a)
                capture.park(key, TapKey.of("expert_ids", layer), ids)
                capture.park(key, TapKey.of("expert_weights", layer), torch.ones(lengths[key], TOP_K))
        for key in batch:
            for layer in range(layers):
                capture.pair(key, TapKey.of("router_logits", layer), taps[(key, layer)][1])
                if train_ids:
                    own = routing.topk_ids(taps[(key, layer)][1].nan_to_num(), TOP_K)  # a NaN test's too
                    capture.pair(key, TapKey.of("expert_ids", layer), own)
            capture.finish_prompt(key)
    return capture, taps


LENGTHS = [5, 1, 7, 3]


@pytest.mark.parametrize("batches, rows", [
    ([[0, 1], [2, 3]], None),  # two inference batches, each compared in one call
    ([[0, 1, 2, 3]], 6),  # one batch in calls of at most 6 rows (of whole sequences' layers; a 7-row one alone)
    (None, None),  # no batches named: each sequence on its own
])
def test_batched_routing_equals_the_per_layer_calls(monkeypatch, batches, rows):
    if rows:
        monkeypatch.setattr(route_capture, "SERIAL_ELEMENTS", rows * (2 * TOP_K) ** 2)
        assert route_capture.rows_per_call(torch.zeros(1, EXPERTS), TOP_K) == rows
    layers = 3
    capture, taps = _run(LENGTHS, layers, batches)
    result = capture.result()
    expected = []
    for layer in range(layers):
        a, b = (torch.cat([taps[(k, layer)][side] for k in range(len(LENGTHS))]) for side in (0, 1))
        expected.append(routing.compare_layer(a, b, TOP_K, infer_ids=routing.topk_ids(a, TOP_K),
                                              train_ids=routing.topk_ids(b, TOP_K)))
    for got, want in zip(result.layers, expected):
        for field in ("set_differs", "order_differs", "jaccard", "margin", "near_tie", "kth_tie_infer",
                      "kth_tie_train", "experts_differ"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert any(r.set_differs.any() for r in expected) and any(r.near_tie.any() for r in expected)
    # the experts that ran differ wherever the logits' strict order does, and at tie collisions besides
    assert all(bool((r.experts_differ >= r.set_differs).all()) for r in expected)
    assert any(bool((r.experts_differ & ~r.set_differs).any()) for r in expected)
    assert result.experts_known and result.manifest()["expert_ids_recorded"] == {"infer": True, "train": True}
    flips, first = routing.token_flips(expected)
    starts = [sum(LENGTHS[:k]) for k in range(len(LENGTHS))]
    for key, (start, n) in enumerate(zip(starts, LENGTHS)):
        assert torch.equal(result.flips[key][0], flips[start : start + n])
        assert torch.equal(result.flips[key][1], first[start : start + n])
    assert result.records_checked == sum(LENGTHS) * layers


def _ops(lengths: list[int], layers: int) -> int:
    """Torch calls (functions and tensor methods; not attribute reads such as .shape) the routing capture makes for
    one inference batch of these sequences."""
    counted = Counter()

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") != "__get__":
                counted[func] += 1
            return func(*args, **(kwargs or {}))

    finish = RouteCapture.finish_prompt

    def counting(self, key):
        with Count():
            finish(self, key)

    RouteCapture.finish_prompt = counting
    try:
        _run(lengths, layers, [list(range(len(lengths)))])
    finally:
        RouteCapture.finish_prompt = finish
    return sum(counted.values())


def test_ops_per_batch_do_not_grow_with_its_sequences_or_layers():
    """The issue-28 tap-cost fix: per sequence and layer, the comparison was tens of small ops (kernel launches on
    a GPU) and a read-back per sequence; per batch (of up to rows_per_call rows) it is a fixed number."""
    assert _ops([5, 3], layers=2) == _ops([5, 3, 7, 2, 4, 1], layers=5)


def test_the_first_failing_sequence_is_named(monkeypatch):
    """Checked per batch, reported as before: the first sequence in run order, and in it non-finite logits before a
    bad route, then the first layer and token."""
    with pytest.raises(RouteRecordError, match="token 2 of sequence 1 in layer 1 ") as e:
        _run([4, 5, 6], 2, [[0, 1, 2]], bad=(1, 1, 2))
    assert "\n" not in str(e.value)
    original = _logits

    def with_nan(rows, seed):  # sequence 2, layer 0, the trainer's side, row 1
        a, b = original(rows, seed)
        if seed == 200:
            b = torch.where(torch.arange(rows)[:, None] == 1, float("nan"), b).to(b.dtype)
        return a, b

    monkeypatch.setattr(sys.modules[__name__], "_logits", with_nan)
    with pytest.raises(NumericsError, match=r"training stack's router logits of layer 0 hold NaN/Inf \(sequence 2\)"):
        _run([4, 5, 6], 2, [[0, 1, 2]], bad=(2, 1, 0))


def test_without_the_trainers_ids_no_flip_is_counted_and_the_manifest_says_so():
    """A side that hands over no expert ids: the logit comparison stays, the experts columns are empty, and no count
    of the logits takes their name."""
    import pandas as pd

    result = _run([4, 5], 2, [[0, 1]], train_ids=False)[0].result()
    assert not result.experts_known and result.ids_recorded == {"infer": True, "train": False}
    table = result.table()
    assert table["frac_experts_differ"].isna().all() and table["frac_topk_set_differs"].notna().all()
    assert "training stack handed over no expert ids" in result.manifest()["experts_not_compared"]
    tokens = pd.DataFrame({"prompt_id": [0, 1], "position": [1, 1], "delta_logprob": [0.1, 0.2]})
    columns = result.token_columns(tokens)
    assert columns[["routing_flips", "first_flip_layer", "upstream_flip"]].isna().all().all()
    assert all(v != v for v in result.summary(columns).values())


def test_a_batch_left_unfinished_is_an_error_not_a_silent_gap():
    """result() with a named batch whose sequences were not all finished: their routing was never compared."""
    from divergence_probe.errors import StackError

    capture = RouteCapture(_NoPairing(), num_layers=1, top_k=TOP_K, metrics=True, records=False)
    capture.add_sequences([_Seq(0, 0), _Seq(1, 1)])
    engine, trainer = _logits(4, seed=0)
    capture.park(0, TapKey.of("router_logits", 0), engine)
    capture.pair(0, TapKey.of("router_logits", 0), trainer)
    capture.finish_prompt(0)
    with pytest.raises(StackError, match="2 sequence.s. of the last batch were never compared"):
        capture.result()
