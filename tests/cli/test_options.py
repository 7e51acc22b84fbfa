"""Every command's options are its spec's fields (cli/options.py): each field a flag, no flag without a field but
the command line's own, and a field added to a spec a new flag with no edit in cli/."""

from __future__ import annotations

import dataclasses

import pytest
import typer

from divergence_probe.cli import app
from divergence_probe.options import option
from divergence_probe.spec.fields import flag_of

OWN = {"compare": {"--out", "--fail-if"}, "ablate": {"--out", "--fail-if"}, "rl": {"--out", "--report"},
       "score": {"--out", "--fail-if", "--alarm"}}  # what steers the command line itself, not the run


def _flags(name: str) -> set[str]:
    group = typer.main.get_command(app)
    command = group.get_command(typer.Context(group, info_name="divergence-probe"), name)
    return {p.opts[0] for p in command.params if p.param_type_name == "option"}


def _spec_flags(name: str) -> set[str]:
    from divergence_probe.spec.load import LoadSpec
    from divergence_probe.spec.rl import RLSpec
    from divergence_probe.spec.run import flat_fields
    from divergence_probe.spec.score import SCORE_FLAGS, ScoreSpec

    if name == "rl":
        return {flag_of(f) for f in RLSpec.option_fields()}
    if name == "score":
        load = {f.name: f for f in dataclasses.fields(LoadSpec)}
        return ({flag_of(f) for f in dataclasses.fields(ScoreSpec) if f.metadata.get("cli", True)}
                | {flag_of(load[field]) for part, field, _ in SCORE_FLAGS if part == "load"})
    return {flag_of(f) for _, f, _ in flat_fields(name)}


@pytest.mark.parametrize("name", sorted(OWN))
def test_every_option_is_a_spec_field(name):
    assert _flags(name) == _spec_flags(name) | OWN[name]


def _with_field(cls):
    """`cls` with one more option field, as a change that adds a spec field would make it."""
    return dataclasses.make_dataclass(cls.__name__, [("added_knob", int, option(3, "A knob a change adds."))],
                                      bases=(cls,), frozen=True, kw_only=True)


@pytest.mark.parametrize("name, module, attribute", [
    ("score", "divergence_probe.spec.score", "ScoreSpec"),
    ("rl", "divergence_probe.spec.rl", "RLSpec"),
])
def test_a_spec_field_added_is_a_new_option(name, module, attribute, monkeypatch):
    import importlib

    from divergence_probe.cli import options

    spec_module = importlib.import_module(module)
    monkeypatch.setattr(spec_module, attribute, _with_field(getattr(spec_module, attribute)))
    params = {p.name: p for p in options.parameters(options.score_flags() if name == "score" else options.rl_flags())}
    assert params["added_knob"].default.param_decls == ("--added-knob",)
    assert params["added_knob"].default.help == "A knob a change adds."


def test_a_run_spec_field_added_is_an_option_of_compare_and_ablate(monkeypatch):
    from divergence_probe.cli import options
    from divergence_probe.spec import run

    monkeypatch.setitem(run.COMPONENTS, "capture", _with_field(run.COMPONENTS["capture"]))
    for kind in ("compare", "ablate"):
        added = [p for p in options.parameters(options.run_flags(kind)) if p.name == "added_knob"]
        assert [p.default.rich_help_panel for p in added] == ["Capture"]


def test_rl_takes_its_model_engine_trainer_and_prompt_options_from_the_shared_parts():
    """RLSpec declares none of the fields of the specs it composes: rl's model, engine and trainer options are a
    LoadSpec's fields and --prompts a PromptSpec's, made into flags as score's are; the manifest records them nested
    and a rerun reads back the same spec."""
    import json

    from divergence_probe.cli import options
    from divergence_probe.spec.from_manifest import recorded
    from divergence_probe.spec.load import LoadSpec
    from divergence_probe.spec.prompts import PromptSpec
    from divergence_probe.spec.rl import PARTS, RLSpec, rl_spec

    shared = {f.name for part in (LoadSpec, PromptSpec) for f in dataclasses.fields(part)}
    assert not ({f.name for f in dataclasses.fields(RLSpec)} - set(PARTS)) & shared  # `prompts`: the PromptSpec itself
    owners = {flag.name: flag.owner for flag in options.rl_flags()}
    assert {name for name, owner in owners.items() if owner is LoadSpec} == {
        "model", "device", "engine", "engine_args", "seed", "train_precision", "train_kernels", "allow_untested_versions"}
    assert owners["prompts"] is PromptSpec and owners["steps"] is RLSpec
    spec = rl_spec(steps=3, seed=5, engine_args='{"max_num_seqs": 4}', setting=("none", "rope"))
    assert (spec.load.seed, spec.load.engine_args, spec.seed_list) == (5, {"max_num_seqs": 4}, (5,))
    assert recorded(RLSpec, json.loads(json.dumps(spec.to_dict())), "spec") == spec


def test_an_rl_spec_recorded_flat_by_an_earlier_release_reads_back_as_the_same_spec():
    """Before RLSpec was composed of its parts, the manifest recorded rl's options side by side: rerun regroups them."""
    import json

    from divergence_probe.spec.from_manifest import recorded
    from divergence_probe.spec.rl import RLSpec, regrouped, rl_spec

    spec = rl_spec(steps=2, seed=7, device="cpu", prompts=None, setting=("none", "rope"), train_precision="amp")
    flat = json.loads(json.dumps(spec.options()))  # what asdict of the flat RLSpec wrote: its fields were the options
    assert recorded(RLSpec, regrouped(flat), "spec") == spec
    assert regrouped(spec.to_dict()) == spec.to_dict()
