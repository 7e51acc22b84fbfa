"""rl on a mixture of experts asks the stacks' declarations (Capabilities.records_routes, replays_routes) whether they
record and replay routes, and refuses a stack that does not declare one in one line, before anything loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from divergence_probe.errors import ProbeError
from divergence_probe.rl.loop import check_route_roles


def _load(infer: str, train: str, ranks: int = 1) -> SimpleNamespace:
    return SimpleNamespace(infer=infer, engine="eager", engine_ranks=ranks, train=train, train_tp=1)


def test_shipped_stacks_record_and_replay_routes():
    check_route_roles(_load("vllm", "hf"), replays=True)


def test_a_single_rank_of_the_sharded_engine_is_what_records():
    with pytest.raises(ProbeError, match="does not declare") as e:
        check_route_roles(_load("vllm", "hf", ranks=2), replays=False)
    assert "\n" not in str(e.value) and "2 rank(s)" in str(e.value)


def test_an_engine_that_does_not_declare_recording_is_refused(toy):
    with pytest.raises(ProbeError, match="the toy stack .* does not declare it can") as e:
        check_route_roles(_load("toy", "hf"), replays=False)
    assert "\n" not in str(e.value)


def test_a_trainer_that_does_not_declare_replaying_is_refused_only_when_a_setting_replays(toy):
    check_route_roles(_load("vllm", "toy"), replays=False)
    with pytest.raises(ProbeError, match="the toy trainer does not declare it can") as e:
        check_route_roles(_load("vllm", "toy"), replays=True)
    assert "\n" not in str(e.value)
