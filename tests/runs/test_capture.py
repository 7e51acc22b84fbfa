"""TapPairing: pairs grouped by shape, reduced by the fused kernel, equal to reducing each tap on its own."""

from __future__ import annotations

import pytest
import torch

from divergence_probe.runs.capture import TapPairing
from divergence_probe.errors import StackError
from divergence_probe.numerics.metrics import DiffStats
from divergence_probe.models import get_family
from divergence_probe.taps import expected_taps

QWEN2_TAPS, QWEN3_TAPS = get_family("qwen2").layer_taps, get_family("qwen3").layer_taps

KEYS = expected_taps(frozenset({"embed", "input_norm", "swiglu", "logits"}), num_layers=3, layer_taps=QWEN2_TAPS)
WIDTH = {"embed": 64, "input_norm": 64, "swiglu": 192, "logits": 100}


def _taps(seed: int, tokens: int):
    """(inference, training) tensors per key: nearly equal BF16, as two stacks give."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key in KEYS:
        rows = tokens - 1 if key.name == "logits" else tokens
        ref = torch.randn(rows, WIDTH[key.name], generator=g).to(torch.bfloat16)
        test = (ref.float() * (1 + 1e-2 * torch.randn(ref.shape, generator=g))).to(torch.bfloat16)
        out[key] = (test, ref)
    return out


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_pairing_equals_diffstats_of_each_tap_merged_over_prompts():
    pairing = TapPairing(KEYS)
    prompts = {0: _taps(0, tokens=7), 1: _taps(1, tokens=12)}
    for pid, taps in prompts.items():  # the inference batch first, as compare runs it
        for key, (test, _) in taps.items():
            pairing.park(pid, key, test)
    for pid, taps in prompts.items():
        for key, (_, ref) in reversed(taps.items()):  # arrival order does not matter
            pairing.pair(pid, key, ref)
        pairing.finish_prompt(pid)
    for key in KEYS:
        want = DiffStats.of(*prompts[0][key]).merge(DiffStats.of(*prompts[1][key]))
        got = pairing.stats[key]
        assert (got.n, got.n_equal, got.max_abs, got.max_ulp) == (want.n, want.n_equal, want.max_abs, want.max_ulp)
        for name in ("sum_abs", "sum_sq_diff", "sum_sq_ref", "sum_sq_test"):
            assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-6), (key.label, name)


def test_vllm_step_taps_are_cloned_once_and_survive_buffer_reuse():
    """vLLM overwrites its buffers after the hook returns: what each prompt's view shows must not change."""
    from divergence_probe.engines.vllm.step import _Step

    step = _Step(spans={0: (0, 2), 1: (2, 3)})
    live = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    emitted = {}
    step.split(live, lambda pid, key, x: emitted.__setitem__(pid, x), KEYS[0])
    live.zero_()
    assert emitted[0].tolist() == [[0, 1], [2, 3]] and emitted[1].tolist() == [[4, 5], [6, 7], [8, 9]]
    assert emitted[0].untyped_storage().data_ptr() == emitted[1].untyped_storage().data_ptr()  # one clone


def test_vllm_step_taps_nothing_overwrites_are_kept_without_a_copy():
    from divergence_probe.engines.vllm.step import REWRITTEN, _Step

    swiglu = next(key for key in KEYS if key.name == "swiglu")
    assert swiglu.name not in REWRITTEN
    live = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    emitted = {}
    _Step(spans={0: (0, 2), 1: (2, 3)}).split(live, lambda pid, key, x: emitted.__setitem__(pid, x), swiglu)
    assert emitted[1].tolist() == [[4, 5], [6, 7], [8, 9]]
    assert emitted[0].untyped_storage().data_ptr() == live.untyped_storage().data_ptr()  # a view, no copy


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_stacked_hand_overs_equal_the_same_taps_handed_over_one_by_one():
    """A compiled engine hands a prompt's taps of one width as one [taps, tokens, features] tensor: the statistics
    must be those of the same pairs handed over singly, per tap (the stack's order is its keys' order, not the
    training side's)."""
    widths = [key for key in KEYS if WIDTH[key.name] == 64]
    stacked_keys = tuple(reversed(widths))
    prompts = {0: _taps(0, tokens=7), 1: _taps(1, tokens=12)}
    singly, stacked = TapPairing(KEYS), TapPairing(KEYS)
    for pid, taps in prompts.items():
        for key, (test, _) in taps.items():
            singly.park(pid, key, test)
            if key not in stacked_keys:
                stacked.park(pid, key, test)
        stacked.park(pid, stacked_keys, torch.stack([taps[key][0] for key in stacked_keys]))
    for pid, taps in prompts.items():
        for pairing in (singly, stacked):
            for key, (_, ref) in taps.items():
                pairing.pair(pid, key, ref)
            pairing.finish_prompt(pid)
    for key in KEYS:
        want, got = singly.stats[key], stacked.stats[key]
        assert (got.n, got.n_equal, got.max_abs, got.max_ulp) == (want.n, want.n_equal, want.max_abs, want.max_ulp)
        assert got.sum_sq_diff == pytest.approx(want.sum_sq_diff, rel=1e-6), key.label
        assert got.n == DiffStats.of(*prompts[0][key]).merge(DiffStats.of(*prompts[1][key])).n


def test_a_stacked_hand_over_is_checked_per_tap():
    """A tap both stacked and single, a stacked tap the model lacks, and a training tap that does not match its row
    of the stack: each an error naming the tap."""
    widths = tuple(key for key in KEYS if WIDTH[key.name] == 64)
    taps = _taps(0, tokens=5)
    pairing = TapPairing(KEYS)
    pairing.park(0, widths, torch.stack([taps[key][0] for key in widths]))
    pairing.park(0, widths[1], taps[widths[1]][0])
    _paired(pairing, lambda key, t: t if key in widths else None)
    with pytest.raises(StackError, match=f"tap {widths[1].label} twice"):
        pairing.finish_prompt(0)
    from divergence_probe.taps import TapKey

    with pytest.raises(StackError, match="up_proj@0, which this model should not have"):
        TapPairing(KEYS).park(0, (widths[0], TapKey.of("up_proj", 0)), torch.zeros(2, 5, 64))
    pairing = TapPairing(KEYS)
    for key, (test, _) in taps.items():
        if key not in widths:
            pairing.park(0, key, test)
    pairing.park(0, widths, torch.stack([taps[key][0] for key in widths]))
    _paired(pairing, lambda key, t: t[:-1] if key == widths[2] else t)
    with pytest.raises(StackError, match=rf"tap {widths[2].label} is \(5, 64\) torch.bfloat16 \(inference\) vs \(4, 64\)"):
        pairing.finish_prompt(0)


def test_vllm_stacked_step_taps_are_views_of_the_step_per_prompt():
    """A compiled engine's taps of one width, [taps, rows, features], are its live buffers, written again only by its
    next step: each prompt gets a view of its own rows, not a copy (base.TapSink: valid until the stack's next call)."""
    from divergence_probe.engines.vllm.step import _Step

    live = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    emitted = {}
    _Step(spans={0: (0, 2), 1: (2, 3)}).split(live, lambda pid, tap, x: emitted.__setitem__(pid, (tap, x)),
                                              tuple(KEYS[:2]))
    for pid, start, length in ((0, 0, 2), (1, 2, 3)):
        tap, x = emitted[pid]
        assert tap == tuple(KEYS[:2]) and x.shape == (2, length, 3)
        assert x.data_ptr() == live[0, start].data_ptr() and torch.equal(x, live[:, start : start + length])


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_a_strided_stacked_hand_over_reduces_as_its_contiguous_copy():
    """A prompt's rows of a step's buffer (a view with the other prompts' rows between its taps) give the statistics of
    the same taps copied out, bit for bit, over prompts at several offsets."""
    from divergence_probe.engines.vllm.step import _Step

    widths = tuple(key for key in KEYS if WIDTH[key.name] == 64)
    prompts = {0: _taps(0, tokens=5), 1: _taps(1, tokens=9), 2: _taps(2, tokens=3)}
    spans, row = {}, 2  # two rows of padding first: no prompt starts at the buffer's start
    for pid, taps in prompts.items():
        spans[pid], row = (row, len(taps[widths[0]][0])), row + len(taps[widths[0]][0])
    live = torch.zeros(len(widths), row + 4, 64, dtype=torch.bfloat16)
    for pid, taps in prompts.items():
        start, length = spans[pid]
        live[:, start : start + length] = torch.stack([taps[key][0] for key in widths])
    strided, copied = TapPairing(KEYS), TapPairing(KEYS)
    for pairing, keep in ((strided, lambda x: x), (copied, lambda x: x.clone(memory_format=torch.contiguous_format))):
        _Step(spans=spans).split(live, lambda pid, tap, x: pairing.park(pid, tap, keep(x)), widths)
        for pid, taps in prompts.items():
            for key, (test, ref) in taps.items():
                if key not in widths:
                    pairing.park(pid, key, test)
                pairing.pair(pid, key, ref)
            pairing.finish_prompt(pid)
    assert not next(iter(strided._plans.values())).groups[0].singles  # the stack went in as it was handed over
    assert strided.stats == copied.stats


def _parked(keys=KEYS):
    pairing = TapPairing(keys)
    for key, (test, _) in _taps(0, tokens=5).items():
        pairing.park(0, key, test)
    return pairing


def test_a_tap_missing_on_the_training_side_fails_at_finish():
    pairing = _parked()
    for key, (_, ref) in list(_taps(0, tokens=5).items())[1:]:
        pairing.pair(0, key, ref)
    with pytest.raises(StackError, match="inference-only taps: embed@-1"):
        pairing.finish_prompt(0)


def test_a_tap_missing_on_both_sides_fails_at_finish():
    pairing = TapPairing(KEYS)
    for key, (test, ref) in _taps(0, tokens=5).items():
        if key.name != "swiglu":
            pairing.park(0, key, test)
            pairing.pair(0, key, ref)
    with pytest.raises(StackError, match=f"{len(KEYS) - 3} of {len(KEYS)} taps paired"):
        pairing.finish_prompt(0)


def _paired(pairing, change=None, pid=0, tokens=5):
    """File every training tap of prompt `pid`; `change(key, tensor)` may swap one (None: drop it)."""
    for key, (_, ref) in _taps(0, tokens=tokens).items():
        ref = change(key, ref) if change else ref
        if ref is not None:
            pairing.pair(pid, key, ref)
    return pairing


@pytest.mark.parametrize("bad, message", [
    (lambda t: t[:-1], r"tap input_norm@0 is \(5, 64\) torch.bfloat16 \(inference\) vs \(4, 64\)"),
    (lambda t: t.float(), r"tap input_norm@0 is \(5, 64\) torch.bfloat16 \(inference\) vs \(5, 64\) torch.float32"),
])
def test_mismatched_partner_is_an_error_naming_the_tap(bad, message):
    """Checked once per group of same-shape taps, at finish; the message still names the tap."""
    target = KEYS[1]
    assert target.label == "input_norm@0"
    pairing = _paired(_parked(), lambda key, t: bad(t) if key == target else t)
    with pytest.raises(StackError, match=message):
        pairing.finish_prompt(0)


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_mismatch_in_a_later_prompt_is_caught_under_a_planned_order():
    """The second prompt reuses the first one's plan; its own mismatch must still be caught and named."""
    pairing = TapPairing(KEYS)
    for pid in (0, 1):
        for key, (test, _) in _taps(0, tokens=5).items():
            pairing.park(pid, key, test)
    _paired(pairing, pid=0).finish_prompt(0)
    target = KEYS[-1]
    _paired(pairing, lambda key, t: t[:, :-1] if key == target else t, pid=1)
    with pytest.raises(StackError, match=f"tap {target.label} is"):
        pairing.finish_prompt(1)


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_prompts_whose_taps_group_otherwise_are_reduced_by_their_own_grouping():
    """Two taps of one shape in the first prompt (one stack) but not in the second: the second prompt gets its own
    grouping, and every tap's statistics still equal its own DiffStats."""
    keys = expected_taps(frozenset({"input_norm"}), num_layers=2, layer_taps=QWEN2_TAPS)
    pairing = TapPairing(keys)
    g = torch.Generator().manual_seed(5)
    pairs = {0: [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in keys],
             1: [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)),
                 (torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g))]}
    for pid, taps in pairs.items():
        for key, (test, ref) in zip(keys, taps):
            pairing.park(pid, key, test)
            pairing.pair(pid, key, ref)
        pairing.finish_prompt(pid)
    for i, key in enumerate(keys):
        want = DiffStats.of(*pairs[0][i]).merge(DiffStats.of(*pairs[1][i]))
        assert (pairing.stats[key].n, pairing.stats[key].max_abs) == (want.n, want.max_abs)


def test_training_only_and_duplicate_taps_are_errors():
    pairing = _parked()
    key = KEYS[1]
    pairing.pair(1, key, _taps(0, tokens=5)[key][1])
    with pytest.raises(StackError, match="training side only"):
        pairing.finish_prompt(1)
    with pytest.raises(StackError, match="twice"):
        pairing.park(0, key, _taps(0, tokens=5)[key][0])
    pairing = _paired(_parked())
    pairing.pair(0, key, _taps(0, tokens=5)[key][1])
    with pytest.raises(StackError, match="twice"):
        pairing.finish_prompt(0)


def test_capture_holds_one_prompt_of_taps_whatever_the_number_of_prompts(vllm_probe, tmp_path, monkeypatch):
    """What the capture holds, not how long it takes: with one prompt per inference batch (--batch-tokens below a
    prompt's length), when a prompt's taps are reduced the only tap tensors still alive are that prompt's; the
    most tap memory alive is the same for 4 prompts as for 2; and no tap outlives the run. The taps: one vLLM
    clones (q_norm), one it hands over as a view (swiglu), one the tool forms (resid_out), and the logits."""
    import dataclasses
    import gc
    import weakref

    handed: list[tuple[int, weakref.ref]] = []  # every tap tensor either stack handed to the capture
    at_finish: list[tuple[int, set[int], int]] = []  # (prompt reduced, prompts with taps alive, bytes alive)
    park, pair, finish = TapPairing.park, TapPairing.pair, TapPairing.finish_prompt

    def watch(real):
        def wrapped(self, prompt_id, key, tensor):
            handed.append((prompt_id, weakref.ref(tensor)))
            real(self, prompt_id, key, tensor)
        return wrapped

    def finish_watched(self, prompt_id):
        gc.collect()
        alive = [(pid, ref()) for pid, ref in handed]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, t in alive if t is not None}
        at_finish.append((prompt_id, {pid for pid, t in alive if t is not None}, sum(storages.values())))
        del alive
        finish(self, prompt_id)

    monkeypatch.setattr(TapPairing, "park", watch(park))
    monkeypatch.setattr(TapPairing, "pair", watch(pair))
    monkeypatch.setattr(TapPairing, "finish_prompt", finish_watched)
    probe = dataclasses.replace(vllm_probe, settings=dataclasses.replace(vllm_probe.settings, batch_tokens=1))
    most = {}
    for n in (2, 4):
        prompts = tmp_path / f"{n}.txt"
        prompts.write_text("\n\n".join(["The same prompt, again: memory must not grow with their number."] * n))
        handed.clear()
        at_finish.clear()
        run = probe.compare(prompts=prompts, taps="q_norm,swiglu,resid_out,logits")
        assert len(run.prompts) == n and [pid for pid, _, _ in at_finish] == list(range(n))
        for prompt_id, alive, _ in at_finish:
            assert alive == {prompt_id}, (prompt_id, alive)
        most[n] = max(nbytes for _, _, nbytes in at_finish)
        del run
        gc.collect()
        assert all(ref() is None for _, ref in handed)
    assert most[4] == most[2] > 0
