"""Every class the registry hands out, and every stand-in a run puts where a stack goes, conforms to its protocol
(engines/protocol.py) by signature: each method the protocol declares is there, of the same kind (a classmethod, a
method), with the same parameters (names, kinds, which are optional). A protocol the runs call through is otherwise a
promise nobody checks: a stack that misses a call fails only when a run reaches it, and one whose parameters differ
fails only for the caller that passes the one it lacks. Annotations are not compared (they are strings, spelled by
each module); a default's value is the class's own (a sharded class declares for 2 ranks unless told)."""

from __future__ import annotations

import inspect
from typing import Protocol

import pytest

from divergence_probe.engines import SHARDED, STACKS, TRAIN_STACKS, WORKERS, stack_class
from divergence_probe.engines.kept import KeptEngine, KeptOutputs, Recording
from divergence_probe.engines.protocol import (Capabilities, Grafter, Metered, RouteRecorder, RouteReplayer, Stack,
                                               StackInfo, Trainer)

ROLES = {"grafts": Grafter, "replays_routes": RouteReplayer, "records_routes": RouteRecorder, "own_process": Metered}


def _members(protocol: type) -> tuple[dict[str, object], set[str]]:
    """The methods (name -> the protocol's declaration) and data members a protocol declares, its protocol bases'
    included."""
    methods, data = {}, set()
    for base in reversed(protocol.__mro__):
        if base in (Protocol, object) or Protocol not in base.__mro__ or base.__module__ == "typing":
            continue
        data |= set(vars(base).get("__annotations__", {}))
        methods.update({name: value for name, value in vars(base).items() if not name.startswith("_")
                        and (inspect.isfunction(value) or isinstance(value, classmethod))})
    return methods, data


def _shape(method) -> list[tuple[str, object, bool]]:
    function = method.__func__ if isinstance(method, classmethod) else method
    return [(p.name, p.kind, p.default is p.empty) for p in inspect.signature(function).parameters.values()]


def mismatches(cls: type, protocol: type, instance: object | None = None, class_seats: bool = True) -> list[str]:
    """How `cls` departs from `protocol`, one line each (empty: it conforms). `instance`: an unloaded one, where the
    protocol's data members are set in __init__. `class_seats`: False for a stand-in of a loaded stack, which is
    asked nothing before loading (what a class declares is asked of the registry's class)."""
    methods, data = _members(protocol)
    found = []
    for name, declared in methods.items():
        if isinstance(declared, classmethod) and not class_seats:
            continue
        have = inspect.getattr_static(cls, name, None)
        if have is None:
            found.append(f"{cls.__name__} has no {name}")
        elif isinstance(declared, classmethod) != isinstance(have, classmethod) or not (
                inspect.isfunction(have) or isinstance(have, classmethod)):
            found.append(f"{cls.__name__}.{name} is a {type(have).__name__}, the protocol's a "
                         f"{type(declared).__name__}")
        elif _shape(have) != _shape(declared):
            found.append(f"{cls.__name__}.{name}{inspect.signature(have.__func__ if isinstance(have, classmethod) else have)}"
                         f" differs from {protocol.__name__}.{name}{inspect.signature(declared.__func__ if isinstance(declared, classmethod) else declared)}")
    for name in sorted(data):
        if inspect.getattr_static(cls, name, None) is None and name not in vars(instance if instance is not None else cls):
            found.append(f"{cls.__name__} has no {name}")
    return found


def _registered() -> list[tuple[str, int, bool]]:
    return ([(name, 1, False) for name in STACKS] + [(name, 2, False) for name in SHARDED]
            + [(name, 1, True) for name in WORKERS])


@pytest.mark.parametrize("name,ranks,worker", _registered())
def test_every_registered_class_conforms_to_stack_and_to_the_roles_it_declares(name, ranks, worker):
    """The calls a run makes of it (Stack) and each optional role its declaration says it plays (its pre-load
    policy, StackClass, is test_protocol's)."""
    cls = stack_class(name, ranks, worker=worker)
    assert mismatches(cls, Stack, None if worker else cls()) == []  # a worker is made for settings; its members are
    declared = cls.declare("eager", ranks)                           # the class's
    for role, protocol in ROLES.items():
        if getattr(declared, role):
            assert mismatches(cls, protocol) == [], role


@pytest.mark.parametrize("name", TRAIN_STACKS)
def test_every_in_process_trainer_conforms_to_trainer(name):
    """rl and ablate drive the training side through protocol.Trainer: its forward, numerics, capture and kernels."""
    cls = stack_class(name)
    assert mismatches(cls, Trainer, cls()) == []


def test_the_stand_ins_a_run_puts_where_a_stack_goes_conform():
    """An engine pass's recordings (--placement alternate) answer the run loop's calls as the engine they stand in
    for."""
    kept = KeptOutputs()
    engine = KeptEngine(kept, Capabilities(taps={}), StackInfo("vllm"))
    assert mismatches(KeptEngine, Stack, engine, class_seats=False) == []
    assert mismatches(Recording, Stack, Recording(engine, kept), class_seats=False) == []


def test_the_check_sees_a_missing_method_and_a_changed_signature():
    """The check itself: a stack that lacks a call, takes a parameter the protocol does not, drops a default or
    declares at the class what the protocol asks of the instance is named, and one that conforms is not."""
    from divergence_probe.engines.hf.trainer import HFStack

    class Conforming(HFStack):
        pass

    class Broken(HFStack):
        def score_batched(self, prompts, taps=frozenset(), sink=None, *, patched=()):
            ...

        def numerics(self, kind, strict):
            ...

        def forward(self, ids, mask, positions, routes=None):  # routes no longer keyword-only
            ...

        @classmethod
        def capabilities(cls):
            ...

        begin_run = None

    assert mismatches(Conforming, Trainer, Conforming()) == []
    found = mismatches(Broken, Trainer, Broken())
    assert [line.split("(")[0].split(" is ")[0] for line in found] == [
        "Broken.capabilities", "Broken.score_batched", "Broken has no begin_run", "Broken.forward", "Broken.numerics"]


def test_a_call_a_stack_cannot_serve_raises_the_refusal_it_declared():
    """Conforming by signature is not serving: a recorded file samples nothing and was batched by no one, and a
    sharded trainer's ranks only score. Each such call raises the line its class declares, the one the spec refuses
    the feature with before anything loads."""
    import torch

    from divergence_probe.engines.hf.tensor_parallel import ShardedHFStack
    from divergence_probe.engines.protocol import SamplingSpec, StackSettings
    from divergence_probe.engines.recorded.stack import RecordedStack
    from divergence_probe.errors import StackError

    recorded = RecordedStack({0: [-0.5]})
    sharded = ShardedHFStack()
    sharded.settings = StackSettings(model_path="unused", dtype=torch.bfloat16, device="cpu", train_tp=2)
    for stack, feature, call in [
            (recorded, "--mode generate", lambda s: s.sample([], SamplingSpec(), frozenset(), print)),
            (recorded, "--batch-invariance", lambda s: s.score_batched([])),
            (recorded, "--batch-invariance", lambda s: s.batch_groups([])),
            (sharded, "--mode generate", lambda s: s.sample([], SamplingSpec(), frozenset(), print))]:
        with pytest.raises(StackError) as refused:
            call(stack)
        assert str(refused.value) == stack.capabilities().refused[feature]


@pytest.mark.parametrize("name", sorted(STACKS))
def test_the_patches_a_registered_class_names_are_patchers_of_known_regions(name):
    from divergence_probe.engines.patching import patches_of
    from divergence_probe.regions import REGIONS

    patches = patches_of(name)
    assert set(patches) <= set(REGIONS) and all(callable(patch) for patch in patches.values())
    assert bool(patches) == bool(stack_class(name).patches)


@pytest.mark.parametrize("name, ranks, worker", _registered())
def test_every_registered_class_declares_the_regions_its_patches_align(name, ranks, worker):
    """`aligns` is what a run is checked against before anything loads (spec/run.py), the patches what aligns once
    loaded: the two say the same, in every variant of the class."""
    from divergence_probe.engines.patching import patches_of

    assert set(stack_class(name, ranks, worker=worker).aligns) == set(patches_of(name))
