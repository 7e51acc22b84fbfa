"""Hostile inputs to rl and ablate, and the promises every command keeps that compare kept first: one error line on
stderr and exit code 2 (the libraries' own output silenced), bounded counts, checks before the loads, a full disk
that leaves a rescue folder and no half-written one, and a SIGTERM that stops an engine build at once.

The rl loop's own steps are replaced by a fake (`fake_loop`) where the point is the run folder, not the model;
what needs a real engine runs as a subprocess, as in test_hostile.py.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import divergence_probe.rl as rl
import divergence_probe.rl.experiment as rl_experiment
from divergence_probe.cli import app
from divergence_probe.errors import OutputError
from divergence_probe.rl.reward import RewardError, load_reward, score
from divergence_probe.rl.table import RLWriter
from divergence_probe.signals import Stopped
from test_compare_cli import assert_one_line_error
from test_hostile import dist_files

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


# ------------------------------------------------------------------------------------------------ bounds, early checks
@pytest.mark.parametrize("flags, message", [
    (["--group-size", "4096"], "--group-size must be at most"),
    (["--steps", "1000000000"], "--steps must be from 1 to"),
    (["--seeds", "100000"], "--seeds must be from 1 to"),
    (["--prompts-per-step", "100000"], "--prompts-per-step must be from 1 to"),
    (["--group-size", "256", "--prompts-per-step", "1024"], "responses per step"),
    (["--max-new-tokens", "10000000"], "--max-new-tokens must be from 1 to"),
    (["--lr", "inf"], "--lr is inf; it must be a finite number"),
    (["--lr", "nan"], "--lr is nan; it must be a finite number"),
    (["--lr", "0"], "--lr must be positive"),
    (["--grad-clip", "inf"], "--grad-clip is inf"),
])
def test_rl_counts_are_bounded(flags, message, tmp_path):
    assert_one_line_error(runner.invoke(app, ["rl", *flags, "--out", str(tmp_path / "x")]), message)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args, message", [
    ('{"compilation_config": 3}', "compilation_config needs --engine compiled"),
    ('{"enforce_eager": false}', "--engine eager|compiled chooses it"),
    ('{"dtype": "float16"}', "bfloat16"),
    ('{"max_num_batched_tokens": 64}', "rl sets it itself"),
    ('{"enable_prefix_caching": false}', "prefix caching on"),
])
def test_rl_engine_args_are_refused_before_vllm_is_imported_naming_rls_own_flags(args, message, tmp_path):
    """The keys rl sets itself are refused when the spec is made, in a process that never imports vLLM, and the
    line names no flag of compare's that rl does not have."""
    code = ("import sys, json\nfrom divergence_probe.spec.rl import rl_spec\nfrom divergence_probe.errors import "
            f"ProbeError\ntry:\n    rl_spec(engine_args={args!r})\nexcept ProbeError as e:\n    print(json.dumps("
            "[str(e), 'vllm' in sys.modules]))\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    line, vllm_imported = json.loads(proc.stdout)
    assert message in line and not vllm_imported, (line, vllm_imported)
    for foreign in ("--dtype", "--batch-tokens"):
        assert foreign not in line, line


def test_unknown_rl_engine_arg_fails_before_anything_loads(tmp_path, monkeypatch):
    def no_load(spec):
        raise AssertionError("the model was loaded before --engine-args were checked")

    monkeypatch.setattr(rl_experiment, "load", no_load)
    result = runner.invoke(app, ["rl", "--engine-args", '{"gpu_memory_utilisation": 0.1}', "--out",
                                 str(tmp_path / "x")])
    assert_one_line_error(result, "gpu_memory_utilisation", "gpu_memory_utilization")
    assert not (tmp_path / "x").exists()


def test_build_ahead_is_bounded_by_the_builds(tmp_path):
    result = runner.invoke(app, ["ablate", "--build-ahead", "1000000000000", "--regions", "rope,swiglu",
                                 "--out", str(tmp_path / "x")])
    assert_one_line_error(result, "--build-ahead", "3 engine builds")
    assert not (tmp_path / "x").exists()


def test_cpu_only_sdpa_kernel_is_refused_before_any_load(qwen3_tiny, tmp_path, monkeypatch):
    from divergence_probe.engines.hf.trainer import HFStack

    def no_load(self, settings):
        raise AssertionError("a stack loaded before --train-sdpa was checked")

    monkeypatch.setattr(HFStack, "load", no_load)
    result = runner.invoke(app, ["compare", "--model", str(qwen3_tiny), "--infer", "hf", "--device", "cpu",
                                 "--train-sdpa", "cudnn", "--out", str(tmp_path / "out")])
    assert_one_line_error(result, "--train-sdpa cudnn", "CPU")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ --reward plug-ins
BAD_MODULES = [
    ("raises", "raise RuntimeError('no config here')\n", "RuntimeError: no config here"),
    ("syntax", "def score(p, r)\n    return 1\n", "SyntaxError"),
    ("exits", "import sys\nsys.exit(0)\n", "sys.exit(0)"),
    ("interrupts", "raise KeyboardInterrupt\n", "KeyboardInterrupt"),
    ("dependency", "import no_such_dependency_xyz\n", "no_such_dependency_xyz"),
    ("not_callable", "score = 3\n", "not a function"),
    ("no_function", "def other(p, r):\n    return 1\n", "has no function score"),
]


@pytest.mark.parametrize("case, source, needle", BAD_MODULES, ids=[c[0] for c in BAD_MODULES])
def test_reward_module_that_fails_at_import_is_one_line(case, source, needle, tmp_path, monkeypatch):
    name = f"hostile_reward_{case}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = runner.invoke(app, ["rl", "--reward", f"{name}:score", "--out", str(tmp_path / "x")])
    assert_one_line_error(result, f"{name}:score", needle)
    assert not (tmp_path / "x").exists()


def _exits(p, r):
    sys.exit(0)


def _interrupts(p, r):
    raise KeyboardInterrupt


@pytest.mark.parametrize("reward, needle", [
    (_exits, "sys.exit(0)"), (_interrupts, "KeyboardInterrupt"), (lambda p, r: "1.0", "not a number"),
    (lambda p, r: [1.0, 0.0], "not a number"), (lambda p, r: None, "not a number"),
    (lambda p, r: float("nan"), "finite"),
])
def test_reward_that_exits_or_returns_no_number_is_an_error(reward, needle):
    with pytest.raises(RewardError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        score(reward, "p", "r")


def test_signal_inside_a_reward_still_stops_the_command():
    def stopped(p, r):
        raise Stopped(signal.SIGTERM)

    with pytest.raises(Stopped):
        score(stopped, "p", "r")


def test_builtin_reward_still_loads():
    assert load_reward(None)("f(", ")") == 1.0


# ------------------------------------------------------------------------------------------------ the rl run folder
ROW = {"reward_mean": 0.5, "mean_abs_dlogp": 1e-3, "max_abs_dlogp": 1e-2, "k3": 1e-4, "ppo_clip_frac": 0.0, "entropy": 1.0,
       "grad_norm": 0.1,
       "t_rollout": 1.0, "t_reward": 0.1, "t_update": 1.0, "t_metrics": 0.1, "t_sync": 0.1, "t_check": 0.1}


class FakeProbe:
    class config:
        engine_args: dict = {}

    def manifest(self) -> dict:
        return {"model": {"spec": "fake"}}


class FakeLoop:
    """rl.Loop's contract (run(setting, seed, on_row): spec.steps rows; close) without a model."""

    def __init__(self, probe, spec) -> None:
        self.spec = spec

    def run(self, setting, seed, on_row) -> None:
        for step in range(1, self.spec.steps + 1):
            on_row({"setting": setting, "seed": seed, "step": step, **ROW})

    def close(self) -> None:
        """Nothing loaded beside the run's stacks."""


@pytest.fixture
def fake_loop(monkeypatch, tmp_path):
    """rl.run's loop and probe faked; the temp folder (where rescue folders go) is tmp_path/scratch."""
    monkeypatch.setattr(rl_experiment, "Loop", FakeLoop)
    monkeypatch.setattr(rl_experiment, "load", lambda spec, check=None: FakeProbe())
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


def _full_disk(monkeypatch, on_row: int | None = None, at_finish: bool = False, rescue_too: bool = False):
    """ENOSPC writing the run's row number `on_row` (1-based) or its manifest; in the rescue folder too if rescue_too."""
    real_add, real_json = RLWriter.add, rl.table.write_json

    def rescuing(path: Path) -> bool:
        return "divergence-probe-rescue-" in str(path)

    def full(path: Path) -> bool:
        return rescue_too or not rescuing(path)

    def add(self, row):
        if on_row is not None and full(self.out_dir) and (self.rows + 1 == on_row or rescuing(self.out_dir)):
            self._broken = True
            raise OSError(errno.ENOSPC, "No space left on device")
        real_add(self, row)

    def write_json(obj, path):
        if at_finish and full(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_json(obj, path)

    monkeypatch.setattr(RLWriter, "add", add)
    monkeypatch.setattr(rl.table, "write_json", write_json)


def test_full_disk_mid_run_is_one_line_and_the_steps_done_are_rescued(fake_loop, tmp_path, monkeypatch):
    _full_disk(monkeypatch, on_row=3)
    out = tmp_path / "work" / "run"
    result = runner.invoke(app, ["rl", "--steps", "5", "--out", str(out)])
    assert_one_line_error(result, "rl.csv", "No space left on device", "the run stopped", "the 2 steps done")
    (rescue,) = fake_loop.iterdir()
    assert f"saved to {rescue} instead" in result.output
    assert pd.read_csv(rescue / "rl.csv").step.tolist() == [1, 2]
    assert not (tmp_path / "work").exists(), "a half-written folder, its lock or the folder made for it was left"


def test_full_disk_at_the_end_rescues_the_whole_run(fake_loop, tmp_path, monkeypatch):
    _full_disk(monkeypatch, at_finish=True)
    out = tmp_path / "run"
    with pytest.raises(OutputError, match="manifest.json .*No space left on device.*results were saved to") as e:
        rl.run(rl.RLSpec(steps=3), out)
    assert "\n" not in str(e.value)
    (rescue,) = fake_loop.iterdir()
    manifest = json.loads((rescue / "manifest.json").read_text())
    assert manifest["kind"] == "rl" and manifest["files"]["rl.csv"]["rows"] == 3
    assert (rescue / "rl_summary.csv").is_file()
    assert not out.exists()


def test_full_disk_everywhere_keeps_the_rows_that_reached_the_disk(fake_loop, tmp_path, monkeypatch):
    _full_disk(monkeypatch, on_row=3, rescue_too=True)
    out = tmp_path / "run"
    with pytest.raises(OutputError, match="could not be saved elsewhere either"):
        rl.run(rl.RLSpec(steps=5), out)
    assert pd.read_csv(out / "rl.csv").step.tolist() == [1, 2] and not (out / "manifest.json").exists()
    assert list(fake_loop.iterdir()) == []


def test_first_row_on_a_full_disk_leaves_nothing(fake_loop, tmp_path, monkeypatch):
    _full_disk(monkeypatch, on_row=1)
    out = tmp_path / "run"
    result = runner.invoke(app, ["rl", "--steps", "2", "--out", str(out)])
    assert_one_line_error(result, "rl.csv", "No space left on device")
    assert not out.exists() and list(fake_loop.iterdir()) == []


@pytest.mark.parametrize("umask", [0o002, 0o077])
def test_rl_run_folder_follows_the_umask(umask, fake_loop, tmp_path):
    out = tmp_path / "run"
    before = os.umask(umask)
    try:
        rl.run(rl.RLSpec(steps=2), out)
    finally:
        os.umask(before)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    for name in ("rl.csv", "rl_summary.csv", "manifest.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o666 & ~umask, name


# ------------------------------------------------------------------------------------------------ real engines
def _rl(tmp_path: Path, *flags, python: list[str] | None = None, env: dict | None = None) -> subprocess.Popen:
    """The rl command on the built-in model, as small as it runs, in a process of its own (`python`: what runs the
    command line instead of `-m divergence_probe`), its temp folder and working folder tmp_path."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "HF_HUB_OFFLINE": "1", "COLUMNS": "80", **(env or {})}
    args = ["rl", "--device", "cpu", "--steps", "1", "--group-size", "2", "--prompts-per-step", "1",
            "--max-new-tokens", "4", *flags]
    return subprocess.Popen([sys.executable, *(python or ["-m", "divergence_probe"]), *map(str, args)], env=env,
                            cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# The disk fills once the engine is up (vLLM's own rendezvous file must fit): the process's file size limit drops to
# 100 bytes as rl.csv's first row is written, so that write fails with EFBIG, as on a full disk.
_DISK_FILLS_AT_THE_FIRST_ROW = """
import resource, signal, sys
from divergence_probe.rl.table import RLWriter
from divergence_probe.cli import main
real_add = RLWriter.add
def add(self, row):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
    real_add(self, row)
RLWriter.add = add
sys.argv = ["divergence-probe", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def rl_failures(tmp_path_factory):
    """Two rl runs that fail once both stacks have loaded, started together: a reward that calls sys.exit(0), and
    rl.csv on a disk that fills as its first row is written. {case: (exit code, stderr, work folder)}."""
    runs = {}
    for case in ("exit", "disk"):
        root = tmp_path_factory.mktemp(f"rl-{case}")
        (root / "exiting_reward.py").write_text("import sys\n\ndef score(prompt, response):\n    sys.exit(0)\n")
        if case == "exit":
            proc = _rl(root, "--reward", "exiting_reward:score", "--out", root / "out",
                       env={"PYTHONPATH": f"{REPO}{os.pathsep}{root}"})
        else:
            proc = _rl(root, "--out", root / "out", python=["-c", _DISK_FILLS_AT_THE_FIRST_ROW])
        runs[case] = (proc, root)
    return {case: (proc.wait(timeout=900), proc.communicate()[1], root) for case, (proc, root) in runs.items()}


def tool_lines(err: str) -> list[str]:
    """stderr without the phase lines a long run writes outside a terminal (`NAME…`, `NAME: done in 12.3 s`): the
    error's line must come after them, the last."""
    return [line for line in err.splitlines() if not re.fullmatch(r".*(…|: done in \d+\.\d s)", line)]


@pytest.mark.slow
def test_reward_that_exits_after_the_loads_is_one_line_on_stderr(rl_failures):
    """After both stacks loaded and sampled: exit code 2 and stderr holds the tool's line alone (no vLLM, torch or
    transformers output, no empty line of a progress bar), and nothing is left behind."""
    code, err, root = rl_failures["exit"]
    assert code == 2, err
    assert tool_lines(err) == ["error: the reward function score failed: it called sys.exit(0); fix the plug-in"], err
    assert err.splitlines()[-1].startswith("error: ")
    assert not (root / "out").exists() and dist_files(root) == []


@pytest.mark.slow
def test_rl_on_a_full_disk_is_one_line_and_leaves_nothing(rl_failures):
    code, err, root = rl_failures["disk"]
    assert code == 2, err
    [line] = tool_lines(err)
    assert err.splitlines()[-1] == line and line.startswith("error: cannot write rl.csv in ") and "File too large" in line, line
    assert not (root / "out").exists() and not [p for p in root.iterdir() if p.name.startswith(".out")]
    assert dist_files(root) == []


@pytest.mark.slow
def test_closing_a_worker_while_its_engine_builds_stops_it_at_once(qwen3_tiny, tmp_path, monkeypatch):
    """ablate's worker engines build while the run goes on; a run stopped meanwhile (SIGTERM) closes them: the child
    gets SIGTERM, unwinds its engine start and removes vLLM's rendezvous file, in seconds, not after a timeout."""
    from divergence_probe.models.source import resolve_model
    from divergence_probe.runs.loading import stack_settings
    from divergence_probe.spec import LoadSpec
    from divergence_probe.engines.vllm.worker import STOP_SECONDS, WorkerStack

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the child's temp folder, where vLLM puts vllm_dist_*
    monkeypatch.setenv("DP_ENGINE_LOG", str(tmp_path / "kept"))  # the child's log, kept by close: where it stopped
    settings = stack_settings(LoadSpec(model=str(qwen3_tiny), device="cpu"), resolve_model(str(qwen3_tiny)))
    worker = WorkerStack(settings, ("rope",)).start()
    proc = worker._proc
    try:
        deadline = time.monotonic() + 600
        while not dist_files(tmp_path):  # the engine has begun to start
            assert proc.poll() is None, open(worker._log.name, errors="replace").read()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        worker.close()
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(path.read_text(errors="replace")[-4000:] for path in tmp_path.glob("kept.*"))
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, log)  # stopped by its handler, not killed
    assert took < STOP_SECONDS / 2, (took, log)
    assert log  # the kept log is read: a failure above shows where the child was
    assert dist_files(tmp_path) == []


def test_a_stop_is_passed_on_to_registered_children_at_once():
    """A child that reads no request while it works (a worker building its engine) gets SIGTERM the moment the
    command does, not when the unwinding reaches its close."""
    from divergence_probe.signals import forget, pass_on_to, stop_on_signals

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pass_on_to(child)
        with pytest.raises(Stopped), stop_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        forget(child)
        if child.poll() is None:
            child.kill()


@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_stderr_holds_the_tools_line_alone_unless_verbose(verbose, tmp_path):
    """What a library writes to stderr, through Python or straight to the file descriptor as C++ code does, is
    silenced by default and shown with -v; the error line is there either way."""
    (tmp_path / "chatty_reward.py").write_text(
        "import os, sys\nprint('python chatter', file=sys.stderr)\nos.write(2, b'c-level chatter\\n')\n"
        "raise RuntimeError('broken')\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    env.pop("DP_RAISE_ERRORS", None)
    argv = [sys.executable, "-m", "divergence_probe", *(["-v"] if verbose else []), "rl", "--reward",
            "chatty_reward:score", "--out", str(tmp_path / "out")]
    proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    line = "error: --reward chatty_reward:score: importing chatty_reward failed: RuntimeError: broken; fix the module"
    expected = ["python chatter", "c-level chatter", line] if verbose else [line]
    assert proc.stderr.splitlines() == expected, proc.stderr
    assert not (tmp_path / "out").exists()


def test_max_new_tokens_past_the_context_is_refused_before_any_load(tmp_path, monkeypatch):
    from divergence_probe.engines.hf.trainer import HFStack

    def no_load(self, settings):
        raise AssertionError("a stack loaded before the prompts were checked against the context")

    monkeypatch.setattr(HFStack, "load", no_load)
    result = runner.invoke(app, ["rl", "--device", "cpu", "--max-new-tokens", "30000", "--out", str(tmp_path / "x")])
    assert_one_line_error(result, "--max-new-tokens 30000", "the model's context")
    assert not (tmp_path / "x").exists()


def test_an_update_that_breaks_the_weights_is_blamed_not_the_push(hf_probe):
    """A learning rate that overflows the update leaves NaN in the trainer's weights: the step says so, naming the
    learning rate, instead of the weight check after the push reporting a tensor the push 'missed or cast'."""
    from dataclasses import replace

    from divergence_probe.errors import NumericsError
    from divergence_probe.rl.trainer import Trainer
    from divergence_probe.engines.hf.trainer import HFStack

    stack = HFStack()
    stack.load(replace(hf_probe.settings))
    try:
        trainer = Trainer(stack, lr=float("inf"), grad_clip=1.0)
        logp, _, mask, _ = trainer.forward([(1, 5, 9, 3, 7), (2, 4, 6)], [2, 2])
        with pytest.raises(NumericsError, match="learning rate inf") as e:
            trainer.step(-(logp * mask).sum() / mask.sum())
        assert "not the weight push" in str(e.value) and "\n" not in str(e.value)
    finally:
        stack.close()
