"""The README's recipes run as written (readme_runs.py says which run in the suite, on the built-in model, and why the
others do not): every command parses and builds its run spec, and the runs write the files each recipe says to read.
"""

from __future__ import annotations

import json
import shlex
import shutil

import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.reports.gate import Gate
from divergence_probe.spec import spec_from_flat
from readme_runs import NOT_RUN, PLACEHOLDER, RENDERED, RUN, key, readme_commands

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

COMMANDS = readme_commands()


def test_every_readme_command_is_run_or_says_why_not():
    written = {key(words) for _, words in COMMANDS}
    decided = {command for command, _ in RUN.values()} | set(RENDERED) | set(NOT_RUN)
    assert written - decided == set(), "README commands neither run nor in readme_runs.NOT_RUN"
    ran = {command for command, _ in RUN.values()} | set(RENDERED)
    assert ran - written == set(), "readme_runs runs commands the README no longer has"


@pytest.mark.parametrize("where, words", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_readme_command_parses_and_builds_its_spec(where, words):
    """As written (M stands for a checkpoint; nothing loads): the values parse, and compare/ablate's spec passes every
    check that runs before loading."""
    group = typer.main.get_command(app)
    root = typer.Context(group, info_name="divergence-probe")
    command = group.get_command(root, words[0])
    ctx = command.make_context(words[0], list(words[1:]), parent=root)
    if words[0] in ("compare", "ablate"):
        flags = {k: v for k, v in ctx.params.items() if k not in ("out_dir", "fail_if")}
        Gate.parse(ctx.params["fail_if"], words[0]).check_measured(spec_from_flat(words[0], **flags))


def test_readme_recipes_run_on_the_builtin_model(cli_processes, tmp_path, monkeypatch):
    """The runs of readme_runs.RUN, made as the README writes them (plus their size flags), hold what each recipe
    tells the reader to look at; `report` renders the graft run as written."""
    runs = cli_processes["builtin"]
    for name, (command, extra) in RUN.items():
        manifest = json.loads((runs[name] / "manifest.json").read_text())
        assert manifest["model"]["spec"] == "builtin:default"
        recorded = manifest["command"][1:manifest["command"].index("--out")]
        assert recorded == shlex.split(command) + extra and PLACEHOLDER[0] not in recorded, name
    normal = pd.read_csv(runs["readme-normal"] / "summary.csv").iloc[0]
    assert {"noise_infer_mean_abs_dlogp", "noise_train_mean_abs_dlogp", "noise_train_kernel_mean_abs_dlogp"} \
        <= set(normal.index)
    assert all((runs["readme-normal"] / name).is_file() for name in ("batch_invariance.csv", "kernel_noise.csv"))
    where = pd.read_csv(runs["readme-where"] / "summary.csv").iloc[0]
    assert where["first_inexact"] != "not captured" and "first_over_threshold" in where
    assert {"rel_l2", "max_ulp", "frac_equal"} <= set(pd.read_csv(runs["readme-where"] / "layers.csv").columns)
    families = pd.read_csv(runs["readme-where-local"] / "local_families.csv")
    assert {"family", "local_rel_l2", "propagated_rel_l2", "amplification"} <= set(families.columns) and len(families)
    assert len(pd.read_csv(runs["readme-where-local"] / "depth.csv"))
    for command, run in RENDERED.items():  # `report runs/where-local`, in a folder of its own holding that run
        words = shlex.split(command)
        shutil.copytree(runs[run], tmp_path / words[-1])
        monkeypatch.chdir(tmp_path)
        result = CliRunner().invoke(app, words)
        assert result.exit_code == 0, result.output
        assert (tmp_path / words[-1] / "report" / "report.md").is_file()
