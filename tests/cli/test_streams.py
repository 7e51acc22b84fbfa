"""What reaches stdout and stderr when they are not a terminal: a pipe whose encoding cannot show every character,
a COLUMNS that is no width, a log with no width at all. Model-free: `diff` of two copies of a recorded run folder
(tests/fixtures/legacy_runs). The encoding and the environment are the process's own, so those run in a child."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "tests" / "fixtures" / "legacy_runs" / "generate"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("streams")
    return shutil.copytree(RUN, base / "a"), shutil.copytree(RUN, base / "b")


def child(*args, env: dict) -> subprocess.CompletedProcess:
    """The installed command's entry point (cli.main) in a process of its own, stdout and stderr pipes."""
    return subprocess.run([sys.executable, "-m", "divergence_probe", *map(str, args)], capture_output=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env})


@pytest.mark.engine  # a child process (the suite's marker for those)
def test_a_stdout_that_cannot_encode_keeps_the_exit_code(two_runs, tmp_path):
    """A successful diff on an ASCII stdout exits 0 (1 is a failed gate's code) and shows what it cannot encode as
    `?`; the run folder is written."""
    result = child("diff", *two_runs, "--out", tmp_path / "d", env={"PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr.decode()
    shown = result.stdout.decode("ascii")
    assert "A ? B (diff_summary.csv)" in shown and f"diff: {tmp_path / 'd'}" in shown
    assert (tmp_path / "d" / "diff_summary.csv").is_file() and result.stderr == b""


@pytest.mark.engine
@pytest.mark.parametrize("columns", ["0", "", "wide"])
def test_a_columns_that_is_no_width_leaves_errors_shown(two_runs, tmp_path, columns):
    result = child("diff", two_runs[0], tmp_path / "missing", env={"COLUMNS": columns})
    assert result.returncode == 2
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: run folder") and "missing does not exist" in lines[0]


def test_tables_outside_a_terminal_are_not_cut(two_runs, tmp_path, monkeypatch):
    """Outside a terminal a table takes its own width, whatever COLUMNS says (a CI log's 80 columns cut the
    exponents off numbers): every row of the summary is one line, its name and numbers whole."""
    monkeypatch.setenv("COLUMNS", "60")
    result = CliRunner().invoke(app, ["diff", *map(str, two_runs), "--out", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") == 5}
    assert re.search(r"│ +5\.432e-03 │ +5\.432e-03 │", rows["noise_infer_mean_abs_dlogp (noise floor)"])
    assert len(rows) > 30  # one line per summary column: none wrapped onto a second


# A name rich would read as an emoji code (:fire:) and as style tags ([bold], [/]): each must be printed as typed.
UNRICH = ":fire:[bold]x[/]:smile:"


def test_a_missing_path_is_named_as_typed(two_runs, tmp_path):
    missing = tmp_path / f"gone{UNRICH}"
    result = CliRunner().invoke(app, ["diff", str(two_runs[0]), str(missing)])
    assert result.exit_code == 2
    assert result.output.startswith("error: run folder ") and f"{missing} does not exist" in result.output


@pytest.mark.parametrize("command", ["diff", "report"])
def test_a_written_folder_is_named_as_typed(two_runs, tmp_path, command):
    """The folder on the `diff:` or `report:` line is one to copy and paste: what the user typed, nothing else."""
    folder = tmp_path / f"out{UNRICH}"
    args = [*map(str, two_runs), "--out", str(folder)] if command == "diff" else [
        str(two_runs[0]), "--format", "html", "--out", str(folder)]
    result = CliRunner().invoke(app, [command, *args])
    assert result.exit_code == 0, result.output
    shown = result.output.splitlines()[-1].split(": ", 1)[1]
    assert Path(shown) == (folder if command == "diff" else folder / "report.html")


@pytest.mark.engine  # a child process
def test_the_error_line_keeps_its_style_and_the_users_text(tmp_path):
    """In a terminal `error:` stays bold red, while the option the user typed is shown as typed."""
    result = child("diff", f"--nope{UNRICH}", env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert result.returncode == 2
    line = result.stderr.decode()
    assert line.startswith("\x1b[1;31merror:\x1b[0m ") and f"--nope{UNRICH}" in line
