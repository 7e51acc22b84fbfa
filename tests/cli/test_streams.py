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
