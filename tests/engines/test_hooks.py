"""HookSet replacements: undone on exit, and a second live replacement of one target is a PatchConflict,
within one HookSet or across two, raised before anything changed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from divergence_probe.engines.hooks import HookSet, PatchConflict, Replacement


class Thing:
    def forward(self):
        return "class"


def test_replacements_are_undone_in_reverse_order():
    obj, registry = Thing(), {"kept": 1}
    obj.own = "own"
    with HookSet() as hooks:
        hooks.replace(obj, "forward", lambda: "patched")
        hooks.replace(obj, "own", "patched")
        hooks.replace_item(registry, "kept", 2)
        hooks.replace_item(registry, "new", 3)
        assert (obj.forward(), obj.own, registry) == ("patched", "patched", {"kept": 2, "new": 3})
    assert "forward" not in vars(obj) and obj.forward() == "class" and obj.own == "own"
    assert registry == {"kept": 1}


def test_undone_on_error():
    registry = {}
    with pytest.raises(KeyError), HookSet() as hooks:
        hooks.replace_item(registry, "k", 1)
        raise KeyError("boom")
    assert registry == {}


@pytest.mark.parametrize("same_set", [True, False])
def test_second_replacement_of_a_live_target_conflicts(same_set):
    obj = SimpleNamespace(f=1)
    with HookSet() as first:
        first.replace(obj, "f", 2, owner="region a")
        with HookSet() as other:
            second = first if same_set else other
            with pytest.raises(PatchConflict, match=r"SimpleNamespace\.f is replaced twice \(region a and region b\)"):
                second.replace(obj, "f", 3, owner="region b")
            assert obj.f == 2
    assert obj.f == 1
    with HookSet() as hooks:  # the claim is released with the replacement
        hooks.replace(obj, "f", 4)
        assert obj.f == 4


def test_registry_entry_conflict_names_the_registry():
    registry = {}
    with HookSet() as hooks:
        hooks.replace_item(registry, "sdpa", "taps", owner="a capture", label="ALL_ATTENTION_FUNCTIONS")
        with pytest.raises(PatchConflict, match=r"ALL_ATTENTION_FUNCTIONS\['sdpa'\].*a capture and a region"):
            HookSet().replace_item(registry, "sdpa", "aligned", owner="a region")
    assert registry == {}


def test_apply_changes_nothing_when_any_replacement_conflicts():
    a, b = SimpleNamespace(f=1), SimpleNamespace(f=1)
    with pytest.raises(PatchConflict), HookSet() as hooks:
        hooks.apply([Replacement(a, "f", 2), Replacement(b, "f", 2), Replacement(a, "f", 3)])
    assert a.f == b.f == 1
    with HookSet() as outer, HookSet() as inner:
        outer.replace(b, "f", 5)
        with pytest.raises(PatchConflict):
            inner.apply([Replacement(a, "f", 2), Replacement(b, "f", 2)])
        assert a.f == 1 and b.f == 5


def test_shared_replacements_planned_twice_apply_once():
    module = SimpleNamespace(fn="shipped")
    with HookSet() as hooks:
        hooks.apply([Replacement(module, "fn", "aligned", shared=True),
                     Replacement(module, "fn", "again", shared=True)])
        assert module.fn == "aligned"
    assert module.fn == "shipped"
    with pytest.raises(PatchConflict):  # shared or not, a live one is never replaced again
        with HookSet() as one, HookSet() as two:
            one.apply([Replacement(module, "fn", "aligned", shared=True)])
            two.apply([Replacement(module, "fn", "aligned", shared=True)])
    assert module.fn == "shipped"
