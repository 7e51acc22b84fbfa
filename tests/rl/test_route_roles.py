"""Routes are a role a stack declares (Capabilities.records_routes, replays_routes), asked before anything loads: rl on
a mixture of experts refuses an engine that does not declare recording them, and every command refuses routing replay
on a trainer that does not declare replaying them, each in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from divergence_probe.errors import ProbeError
from divergence_probe.rl.loop import check_route_recording
from divergence_probe.spec import spec_from_flat
from divergence_probe.spec.rl import rl_spec

REPLAY_REFUSED = "routing replays the engine's routes in the trainer, which toy (--train toy) does not declare it " \
                 "can; leave it out of "


def _load(infer: str, ranks: int = 1) -> SimpleNamespace:
    return SimpleNamespace(infer=infer, engine="eager", engine_ranks=ranks)


def test_the_shipped_engine_records_routes():
    check_route_recording(_load("vllm"))


def test_a_single_rank_of_the_sharded_engine_is_what_records():
    with pytest.raises(ProbeError, match="does not declare") as e:
        check_route_recording(_load("vllm", ranks=2))
    assert "\n" not in str(e.value) and "2 rank(s)" in str(e.value)


def test_an_engine_that_does_not_declare_recording_is_refused(toy):
    with pytest.raises(ProbeError, match="the toy stack .* does not declare it can") as e:
        check_route_recording(_load("toy"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind, flags, flag", [
    ("compare", {"align": "routing", "side": "train"}, "--align"),
    ("ablate", {"regions": "routing"}, "--regions"),
])
def test_routing_replay_on_a_trainer_that_does_not_declare_it_is_refused_by_the_spec(toy, kind, flags, flag):
    spec_from_flat(kind, train="hf", taps="none", **flags)  # the shipped trainer declares it
    with pytest.raises(ProbeError) as e:
        spec_from_flat(kind, train="toy", taps="none", **flags)
    assert str(e.value) == REPLAY_REFUSED + flag


def test_rl_refuses_a_routing_setting_on_a_trainer_that_does_not_declare_replaying(toy, monkeypatch):
    from divergence_probe.engines import STACKS

    monkeypatch.setitem(STACKS, "hf", STACKS["toy"])  # rl's trainer resolved to a class that does not declare it
    with pytest.raises(ProbeError) as e:
        rl_spec(setting=["none", "routing"])
    assert str(e.value) == "--setting 'routing': " + REPLAY_REFUSED.replace("toy (--train toy)", "hf (rl's trainer)") \
        + "--setting"


@pytest.mark.parametrize("side", ["both", "train"])
def test_routing_on_a_sharded_trainer_names_the_fix_that_runs(side):
    """A trainer sharded over processes replays no routes: the line names --train-tp 1, never --side infer (routing has
    no inference side, so that fix would be refused in turn)."""
    with pytest.raises(ProbeError) as e:
        spec_from_flat("compare", align="routing", side=side, train_tp=2, taps="none")
    assert str(e.value) == ("routing replays the engine's routes in the trainer, which transformers (--train hf, "
                            "--train-tp 2) does not declare it can; leave it out of --align, or use --train-tp 1")
