"""The opt-in phase timer (timings.py): nothing recorded and one shared do-nothing context while off; nested blocks
add up while on."""

from __future__ import annotations

import time

from divergence_probe import timings


def test_off_records_nothing_and_hands_back_one_shared_context(monkeypatch):
    monkeypatch.delenv(timings.ENV, raising=False)
    timings.start()
    assert not timings.enabled()
    first, second = timings.timed("a"), timings.timed("b")
    assert first is second  # no object made per block: the run loop's cost while off is the call
    with first:
        pass
    timings.add("start", 1.0)
    assert timings.record() is None


def test_on_adds_each_block_to_its_name(monkeypatch):
    monkeypatch.setenv(timings.ENV, "1")
    timings.start()
    try:
        for _ in range(2):
            with timings.timed("outer"), timings.timed("outer.inner"):
                time.sleep(0.01)
        timings.add("start", 0.5)
        seconds = timings.record()
        assert set(seconds) == {"outer", "outer.inner", "start"}
        assert seconds["outer"] >= seconds["outer.inner"] >= 0.02  # two sleeps of 10 ms, added
        assert seconds["start"] == 0.5
    finally:
        monkeypatch.delenv(timings.ENV)
        timings.start()


def test_process_age_counts_from_the_process_start():
    before = timings.process_age()
    time.sleep(0.05)
    after = timings.process_age()
    assert before is not None and before > 0 and after - before >= 0.04
