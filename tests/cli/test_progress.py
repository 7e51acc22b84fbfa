"""The CLI's progress display (cli/console.py, Phases): one bar per long phase, each counting its own work, with the time left;
fed by the API's phases (compare.phase) on the toy stacks (no engine)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

import divergence_probe as dp
from divergence_probe.cli import app
from divergence_probe.cli import console as terminal


@pytest.fixture
def phases(monkeypatch):
    """The CLI's own bars on a console that is a terminal (recorded, so what it drew can be read back)."""
    console = Console(file=io.StringIO(), force_terminal=True, record=True, width=160)
    monkeypatch.setattr(terminal, "console", console)
    with terminal.phases() as shown:
        yield shown


def bars(phases) -> list[tuple[str, float, float]]:
    return [(t.description, t.completed, t.total) for t in phases.bar.tasks]


def test_one_bar_per_phase_each_counting_its_own_work(toy, qwen3_tiny, prompts_file, phases):
    phases.phase("loading")
    probe = dp.load(str(qwen3_tiny), infer="toy-fused", train="toy", device="cpu")
    probe.compare(prompts=prompts_file, taps="none", batch_invariance=True, progress=phases)
    probe.ablate(prompts=prompts_file, taps="none", regions="toy-align", bootstrap=0, progress=phases)
    phases.end()
    assert bars(phases) == [("loading", 1, 1), ("scoring prompts, reducing taps", 3, 3),
                            ("noise floor: each stack alone vs batched, another SDPA kernel", 1, 1),
                            ("combination none (1/2)", 3, 3), ("combination toy-align (2/2)", 3, 3)]
    phases.bar.refresh()
    drawn = phases.bar.console.export_text(clear=False)
    assert "combination toy-align (2/2)" in drawn and "3/3" in drawn
    assert re.search(r"left\s+(\d+:)?\d\d:\d\d", drawn)  # the time left, once a phase has a total


def test_a_plain_callback_sees_what_it_always_saw(toy, qwen3_tiny, prompts_file):
    """The API's progress callback (done, total) without `phase`: cumulative over an ablation's combinations."""
    seen = []
    probe = dp.load(str(qwen3_tiny), infer="toy-fused", train="toy", device="cpu")
    probe.ablate(prompts=prompts_file, taps="none", regions="toy-align", bootstrap=0,
                 progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 6), (2, 6), (3, 6), (4, 6), (5, 6), (6, 6)]


def test_an_80_column_terminal_keeps_the_counts_and_the_time_left(monkeypatch):
    """A long phase name is cut, not the counts or the times after it."""
    console = Console(file=io.StringIO(), force_terminal=True, record=True, width=80)
    monkeypatch.setattr(terminal, "console", console)
    with terminal.phases() as shown:
        shown.phase("noise floor: each stack alone vs batched, another SDPA kernel")
        shown(7, 7)
        shown.phase("combination rope,swiglu,rmsnorm,lm_head,residual (31/32), another long name")
        shown(12, 345)
        frame = Console(file=io.StringIO(), width=80, color_system=None)  # the bars as an 80-column terminal shows them
        frame.print(shown.bar.get_renderable())
        lines = frame.file.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert re.search(r"7/7\s+\d+:\d\d:\d\d left\s+\d+:\d\d$", lines[0]), lines[0]
    assert re.search(r"12/345\s+\d+:\d\d:\d\d left\s+(\d+:\d\d|-+:-+)$", lines[1]), lines[1]


def test_outside_a_terminal_each_phase_writes_lines_and_the_manifest_its_seconds(toy, qwen3_tiny, prompts_file,
                                                                                   tmp_path, monkeypatch):
    """CliRunner's streams are no terminal, as a CI log or `| tee` is not: no bars, a line as a long phase runs and
    one as it ends (every phase is long here: the toy stacks are fast)."""
    import json

    from typer.testing import CliRunner

    monkeypatch.setattr(terminal.Phases, "LOG_AFTER", 0.0)
    result = CliRunner().invoke(app, ["compare", "--model", str(qwen3_tiny), "--infer", "toy-fused", "--train",
                                          "toy", "--prompts", str(prompts_file), "--taps", "none",
                                          "--batch-invariance", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    names = ["loading the model in transformers and the inference stack", "scoring prompts, reducing taps",
             "noise floor: each stack alone vs batched, another SDPA kernel"]
    lines = result.output.splitlines()
    for name in names:
        assert f"{name}…" in lines
        assert any(re.fullmatch(rf"{re.escape(name)}: done in \d+\.\d s", line) for line in lines), name
    phases = json.loads((tmp_path / "run" / "manifest.json").read_text())["phases"]
    assert sorted(phases) == sorted(names) and list(phases)[0] == names[0]
    assert all(isinstance(s, float) and s >= 0 for s in phases.values())
    assert phases[names[0]] > 0  # the load takes time


def test_a_long_phase_is_announced_while_it_runs(monkeypatch):
    """The line that says a phase runs comes from a timer, before the phase ends; a short phase writes no line."""
    import time

    console = Console(file=io.StringIO(), force_terminal=False, width=80)  # stderr, no terminal: the lines go there
    monkeypatch.setattr(terminal, "console", console)
    results = Console(file=io.StringIO(), width=80)  # stdout holds the results alone
    monkeypatch.setattr(terminal, "out", results)
    monkeypatch.setattr(terminal.Phases, "LOG_AFTER", 0.2)
    with terminal.phases() as shown:
        shown.phase("short")
        shown.phase("long")
        deadline = time.monotonic() + 30
        while "long…" not in console.file.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert console.file.getvalue().splitlines() == ["long…"]  # written while the phase runs; "short" wrote none
        shown.end()
    lines = console.file.getvalue().splitlines()
    assert lines[0] == "long…" and re.fullmatch(r"long: done in \d+\.\d s", lines[1]) and len(lines) == 2
    assert results.file.getvalue() == ""


def test_after_a_long_phase_every_phase_writes_its_lines(monkeypatch):
    """Once a log shows a phase, the short ones after it show too: compare's noise floor, a few seconds after a
    scoring of minutes, says that it ran and how long it took."""
    import time

    console = Console(file=io.StringIO(), force_terminal=False, width=80)
    monkeypatch.setattr(terminal, "console", console)
    monkeypatch.setattr(terminal.Phases, "LOG_AFTER", 0.2)
    floor = "noise floor: each stack alone vs batched, another SDPA kernel"
    with terminal.phases() as shown:
        shown.phase("scoring prompts, reducing taps")
        time.sleep(0.3)
        shown.phase(floor)
        shown.end()
    lines = console.file.getvalue().splitlines()
    assert lines[2] == f"{floor}…" and re.fullmatch(rf"{floor}: done in \d+\.\d s", lines[3]) and len(lines) == 4
