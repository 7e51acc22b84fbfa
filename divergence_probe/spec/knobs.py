"""Deployment knobs as ablation factors: `ablate --factor SIDE:KEY=VALUE` beside `--regions`.

A factor is a change of the run's load settings that a deployment makes: an FP8 KV cache or FP8 weights in the engine,
the engine's compiled mode, the trainer's kernel set or its mixed precision. Each knob says its side, its key, the
values the tool measures, the LoadSpec field it changes and how, and who checks a value (the engine's own arg check,
the kernel set's device and package check). Every stack declares its own knobs (StackClass.knobs, read through the
registry's `knobs_of`): a new knob is one entry in its stack's table. An ablation runs every subset of its regions and
factors and splits the change of the mismatch among them (numerics/shapley.py); a factor's combinations load what it changes (the
trainer's kernel set is swapped in place; another precision or another engine is loaded beside the run's own).

A factor's label is read against the registry (engines.parse_factor), beside the knobs it names, so that a spec
checking its factors sits no deeper in the import graph than the registry; what a combination loads is here.
"""

from __future__ import annotations

from ..engines import parse_factor


def applied(load, labels) -> object:
    """The LoadSpec a combination with these factors loads (the run's own, changed by each factor's knob)."""
    from dataclasses import replace

    changes: dict = {}
    for label in labels:
        factor = parse_factor(label, load.infer, load.train)
        current = replace(load, **changes) if changes else load
        changes[factor.knob.field] = factor.knob.change(factor.value, current)
    return replace(load, **changes) if changes else load
