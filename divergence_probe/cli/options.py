"""Every command's options, made one way: from the fields of the spec class that command builds (spec/), each
field's `options.option` metadata its flag, short form and help. A field added to a spec is a new flag of every
command that takes that spec, with no edit here.

A command lists the fields it takes as `Flag`s (compare and ablate: spec.run.flat_fields; rl: spec.rl.RL_FLAGS;
score: spec.score.SCORE_FLAGS) and `parameters` turns them into the keyword parameters typer reads; the options
that steer the command line itself, not the run (--out, --fail-if), are declared here once.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import Field
from pathlib import Path
from typing import NamedTuple, Optional

import typer

OUT_HELP = "New or empty output folder. Default: runs/<date>-<time>-<microseconds>."
OutOpt = typer.Option(None, "--out", "-o", help=OUT_HELP)
FAIL_IF_HELP = ("Exit 1 (after writing everything) when METRIC OP VALUE holds, e.g. mean_kl>1e-3, "
                "mismatch_over_floor>2, first_inexact!=attn_core@0 (OP: > >= < <= == !=; METRIC: a summary column); "
                "repeatable. The verdict is recorded in manifest.json (gate).")


class Flag(NamedTuple):
    """One option a command takes from a spec field: the class that declares it, the field, the parameter's name
    (what the command receives), its --help panel, and its help when the command words it otherwise (None: the
    field's own)."""

    owner: type
    field: Field
    name: str
    panel: str | None = None
    help: str | None = None


def untyped_flags(params: list) -> list:
    """An on/off flag takes no value, so --help shows no type beside it (typer would show `<bool>`)."""
    for param in params:
        if param.param_type_name == "option" and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class Command(typer.core.TyperCommand):
    """Every command's click class: flags shown without a type."""

    def get_params(self, ctx):
        return untyped_flags(super().get_params(ctx))


def command_doc(doc: str) -> str:
    """A command's help as --help shows it: each paragraph on one line, which rich wraps at the terminal's width (a
    docstring's own line breaks would break sentences mid-line there), but the `Examples:` paragraph keeps its lines,
    one command each."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(p if p.startswith("Examples:") else " ".join(p.split()) for p in paragraphs)


def help_from_doc(function):
    """A command function whose docstring is shaped for --help by command_doc."""
    function.__doc__ = command_doc(function.__doc__)
    return function


def _cli_type(hint, default):
    """The typer type and default of a spec field: lists and objects are typed as text and parsed by the spec."""
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin in (tuple, list):  # an empty default: None, so that a value typed empty (--arms "") reads as given
        return (str, ",".join(default)) if default else (Optional[str], None)
    if hint is dict:
        return Optional[str], None
    if args and type(None) in typing.get_args(hint):  # X | None
        return Optional[args[0]], default
    return hint, default


def parameters(flags: typing.Iterable[Flag]) -> list[inspect.Parameter]:
    """One typer option per spec field: its type from the field's annotation, its default the field's, its flag
    spelled as spec.fields.flag_of spells it. A `repeat` field is a flag given once per value."""
    from ..spec.fields import flag_of

    params = []
    for owner, f, name, panel, help_text in flags:
        hint = typing.get_type_hints(owner)[f.name]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        cli_type, cli_default = (Optional[list[str]], None) if f.metadata.get("repeat") else _cli_type(hint, default)
        decls = [flag_of(f)] + ([f.metadata["short"]] if f.metadata.get("short") else [])
        if help_text is None:
            help_text = f.metadata.get("help", "")
            help_text = help_text() if callable(help_text) else help_text  # options.option: help made now
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=cli_type, default=typer.Option(
            cli_default, *decls, help=help_text, rich_help_panel=panel)))
    return params


def keyword(name: str, annotation, option) -> inspect.Parameter:
    """A keyword parameter of a generated command that no spec field declares (--out, --fail-if)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=option)


def out_parameter(panel: str | None = None) -> inspect.Parameter:
    return keyword("out_dir", Optional[Path], typer.Option(None, "--out", "-o", help=OUT_HELP, rich_help_panel=panel))


def fail_if_parameter(panel: str | None = None, help: str = FAIL_IF_HELP) -> inspect.Parameter:
    return keyword("fail_if", Optional[list[str]], typer.Option(None, "--fail-if", help=help, rich_help_panel=panel))


def generated(command, params: list[inspect.Parameter], doc: str, name: str):
    """`command` (a function taking **flags) with `params` as the signature typer reads and `doc` as its --help."""
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = doc
    command.__name__ = name
    return command


# compare's and ablate's --help panels, from each spec field's component (spec.COMPONENTS); LoadSpec's fields are
# split by name between the model, the engine (inference side) and the trainer, so a field added to a component
# lands in its panel without an edit here.
PANELS = {"prompts": "Model and prompts", "capture": "Capture", "generate": "Generate mode",
          "align": "Region alignment", "ablate": "Ablation", None: "Output"}


def _panel(kind: str, component: str | None, name: str) -> str:
    """The --help panel of the option `name` (a flat name, spec.flat_fields) of spec component `component`."""
    if component == "load":
        if name.startswith("train"):
            return "Trainer"
        if name == "infer" or name.startswith("engine") or name == "batch_tokens":
            return "Engine"
        return "Model and prompts"
    if component == "align" and kind == "ablate":  # ablate's --side: where its combinations are aligned
        return "Ablation"
    return PANELS.get(component, "Options")


def run_flags(kind: str) -> list[Flag]:
    """The options of compare or ablate: every RunSpec field a run of `kind` takes (spec.flat_fields)."""
    from ..spec.run import COMPONENTS, RunSpec, flat_fields

    return [Flag(COMPONENTS[component] if component else RunSpec, f, name, _panel(kind, component, name))
            for component, f, name in flat_fields(kind)]


def listed_flags(owners: dict[str, type], table, own: str) -> list[Flag]:
    """The options of a command whose spec composes parts (`owners`: part -> its class): the fields `table` names,
    (part, name, help or None), in its order, then any other field of the command's own part `own` (a field added
    there is a new flag with no edit of the table; a component field of its own, RLSpec's load, is no option)."""
    found = {(part, f.name): f for part, owner in owners.items() for f in dataclasses.fields(owner)
             if f.metadata.get("cli", True) and not (part == own and f.name in owners)}
    listed = {(part, name) for part, name, _ in table}
    return ([Flag(owners[part], found[part, name], name, None, help_text) for part, name, help_text in table]
            + [Flag(owners[own], f, name) for (part, name), f in found.items() if part == own
               and (part, name) not in listed])


def rl_flags() -> list[Flag]:
    """The options of rl: the RLSpec, LoadSpec and PromptSpec fields spec.rl.RL_FLAGS names, in its order."""
    from ..spec.rl import PARTS, RL_FLAGS, RLSpec

    return listed_flags({"rl": RLSpec, **PARTS}, RL_FLAGS, "rl")


def score_flags() -> list[Flag]:
    """The options of score: the ScoreSpec and LoadSpec fields spec.score.SCORE_FLAGS names, in its order, then any
    other ScoreSpec field (the rollouts are score's argument, not an option)."""
    from ..spec.load import LoadSpec
    from ..spec.score import SCORE_FLAGS, ScoreSpec

    return listed_flags({"score": ScoreSpec, "load": LoadSpec}, SCORE_FLAGS, "score")
