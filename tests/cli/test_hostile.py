"""Hostile checkpoints, disks and schedulers: each ends in one error line and exit code 2 (or 128+N for a signal),
before any model loads where that is possible, with nothing left on disk.

Broken checkpoints are copies of make_model's tiny models with config.json edited or model.safetensors rewritten.
They go through the CLI with `--infer hf`: the checks run before either stack loads, so no vLLM engine starts.
Signals, disk limits and vLLM's start-up need a process of their own and run as subprocesses.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.errors import ModelError, StackError
from divergence_probe.models.source import resolve_model
from divergence_probe.rundir import MARK
from divergence_probe.signals import Stopped, stop_on_signals
from divergence_probe.engines.protocol import StackSettings
from divergence_probe.engines.hf.trainer import HFStack

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def broken_copy(src: Path, dst: Path, config=None, weights=None, files=None) -> Path:
    """A copy of checkpoint src with config.json edited by config(dict), the tensors by weights(dict), and the
    folder by files(path)."""
    shutil.copytree(src, dst)
    if config:
        data = json.loads((dst / "config.json").read_text())
        config(data)
        (dst / "config.json").write_text(json.dumps(data))
    if weights:
        tensors = load_file(dst / "model.safetensors")
        weights(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if files:
        files(dst)
    return dst


def assert_one_error_line(result, *needles) -> str:
    """Exit code 2 and exactly one output line, which holds every needle."""
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def assert_nothing_left(parent: Path, before: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == before, "files or hidden temporary folders were left"


def compare_hf(model: Path, out: Path):
    return runner.invoke(app, ["compare", "--model", str(model), "--infer", "hf", "--out", str(out)],
                         catch_exceptions=False)


def _pop(name):
    return lambda d: d.pop(name)


def _set(**fields):
    return lambda d: d.update(fields)


def _truncate(end: int):
    """Keep model.safetensors' bytes [:end]: a cut copy or download."""
    def cut(folder: Path) -> None:
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:end])
    return cut


def _shard_index(folder: Path, drop_shard: bool = False, unlisted: bool = False) -> None:
    """Split model.safetensors into two shards with an index, as save_pretrained does for large models."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, folder / shard, metadata={"format": "pt"})
        weight_map.update({k: shard for k in keys})
    if unlisted:
        del weight_map[names[-1]]
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if drop_shard:
        (folder / "model-00002-of-00002.safetensors").unlink()


def _tokenizer_of_bigger_model(folder: Path) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    data["added_tokens"].append({**data["added_tokens"][0], "id": 151643, "content": "<|big|>"})
    (folder / "tokenizer.json").write_text(json.dumps(data))


# (case, base model, config edit, weights edit, folder edit, what the one line must name)
BROKEN = [
    ("untied_head_missing", "qwen2", _set(tie_word_embeddings=False), None, None,
     ("lm_head.weight", "model.safetensors", "tie_word_embeddings")),
    ("projection_missing", "qwen3", None, _pop("model.layers.1.mlp.up_proj.weight"), None,
     ("model.layers.1.mlp.up_proj.weight", "model.safetensors", "re-export")),
    ("unexpected_tensor", "qwen3", None, lambda w: w.update({"model.layers.0.mlp.extra.weight": torch.ones(4)}), None,
     ("model.layers.0.mlp.extra.weight", "model.safetensors", "remove it")),
    ("shape_contradicts_config", "qwen3", _set(intermediate_size=512), None, None,
     ("model.layers.0.mlp.gate_proj.weight", "intermediate_size=512", "[384, 128]")),
    ("required_field_removed", "qwen3", _pop("hidden_size"), None, None, ("has no 'hidden_size'", "config.json")),
    ("rope_theta_removed", "qwen3", _pop("rope_parameters"), None, None, ("rope_theta", "config.json")),
    ("model_type_removed", "qwen3", _pop("model_type"), None, None, ("model_type", "config.json")),
    ("config_cut", "qwen3", None, None,
     lambda f: (f / "config.json").write_text((f / "config.json").read_text()[:200]), ("config.json",)),
    ("config_wrong_type", "qwen3", _set(num_attention_heads="four"), None, None,
     ("config.json", "transformers cannot build a model")),
    ("layer_count_contradicts_weights", "qwen3",
     lambda d: d.update(num_hidden_layers=3, layer_types=d["layer_types"][:3]), None, None,
     ("num_hidden_layers=3", "model.safetensors", "0..3")),
    ("model_type_of_other_arch", "qwen3", _set(model_type="qwen2", architectures=["Qwen2ForCausalLM"]), None, None,
     ("qwen3", "model_type", "Qwen3ForCausalLM")),
    ("architectures_contradict_model_type", "qwen3", _set(architectures=["Qwen2ForCausalLM"]), None, None,
     ("Qwen2ForCausalLM", "model_type", "config.json")),
    ("truncated_weights", "qwen3", None, None, _truncate(-1000), ("model.safetensors", "truncated")),
    ("cut_header", "qwen3", None, None, _truncate(100), ("model.safetensors", "truncated inside its header")),
    ("no_tokenizer", "qwen3", None, None, lambda f: (f / "tokenizer.json").unlink(),
     ("no tokenizer", "tokenizer.json", "copy the tokenizer")),
    ("tokenizer_of_other_model", "qwen3", None, None, _tokenizer_of_bigger_model,
     ("tokenizer.json", "151643", "vocab_size=2048")),
    ("stray_weights_file", "qwen3", None, None,
     lambda f: shutil.copy(f / "model.safetensors", f / "model-old.safetensors"), ("model-old.safetensors", "vLLM")),
    ("tied_head_differs", "qwen3", None, lambda w: w.update({"lm_head.weight": w["model.embed_tokens.weight"] * 2}),
     None, ("lm_head.weight", "tie_word_embeddings")),
    ("shard_missing", "qwen3", None, None, lambda f: _shard_index(f, drop_shard=True),
     ("model-00002-of-00002.safetensors", "model.safetensors.index.json")),
    ("tensor_not_in_index", "qwen3", None, None, lambda f: _shard_index(f, unlisted=True),
     ("model-00002-of-00002.safetensors", "model.safetensors.index.json", "does not list it")),
    ("single_file_beside_index", "qwen3", None, None,
     lambda f: (shutil.copy(f / "model.safetensors", f / "keep"), _shard_index(f), (f / "keep").rename(f / "model.safetensors")),
     ("model.safetensors", "model.safetensors.index.json", "stale")),
    ("quantized_tensor", "qwen3", None,
     lambda w: w.update({"model.norm.weight": w["model.norm.weight"].to(torch.int8)}), None,
     ("model.norm.weight", "I8")),
]


@pytest.mark.parametrize("case,arch,config,weights,files,needles", BROKEN, ids=[c[0] for c in BROKEN])
def test_broken_checkpoint_is_one_line_before_loading(case, arch, config, weights, files, needles, request, tmp_path):
    base = request.getfixturevalue(f"{arch}_tiny")
    model = broken_copy(base, tmp_path / "model", config, weights, files)
    before = {p.name for p in tmp_path.iterdir()}
    assert_one_error_line(compare_hf(model, tmp_path / "out"), *needles)
    assert_nothing_left(tmp_path, before)


@pytest.mark.parametrize("edit", ["none", "tied_head_identical", "sharded"])
def test_sound_checkpoints_pass(edit, qwen2_tiny, qwen3_tiny, tmp_path):
    """The checks must not refuse what both stacks load identically: both archs, a tied checkpoint that also
    ships an identical lm_head.weight, a sharded checkpoint with its index, and the built-in model."""
    models = [qwen2_tiny, qwen3_tiny]
    if edit == "tied_head_identical":
        models = [broken_copy(qwen3_tiny, tmp_path / "m", weights=lambda w: w.update(
            {"lm_head.weight": w["model.embed_tokens.weight"].clone()}))]
    elif edit == "sharded":
        models = [broken_copy(qwen3_tiny, tmp_path / "m", files=_shard_index)]
    else:
        assert resolve_model(None).num_layers >= 1
    for model in models:
        assert resolve_model(str(model)).path == model.resolve()


def test_transformers_loading_report_is_a_second_line_of_defence(qwen3_tiny, tmp_path):
    """Past model_source's checks (called directly here), transformers' own loading report still stops a run."""
    model = broken_copy(qwen3_tiny, tmp_path / "model", weights=_pop("model.layers.0.self_attn.o_proj.weight"))
    with pytest.raises(ModelError, match=r"missing keys .*model\.layers\.0\.self_attn\.o_proj\.weight"):
        HFStack().load(StackSettings(model_path=str(model), dtype=torch.bfloat16, device="cpu"))


def test_flash_attention_on_cpu_names_the_fix(qwen3_tiny, tmp_path):
    result = runner.invoke(app, ["compare", "--model", str(qwen3_tiny), "--infer", "hf", "--device", "cpu",
                                 "--train-attn", "flash_attention_2", "--out", str(tmp_path / "out")])
    assert_one_error_line(result, "flash_attention_2", "CUDA", "--train-attn sdpa")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_without_flash_attn_names_the_fix(qwen3_tiny):
    """The package check comes before any CUDA use, so it runs on a CPU-only machine too."""
    with pytest.raises(StackError, match="needs the flash-attn package.*pip install flash-attn"):
        HFStack().load(StackSettings(model_path=str(qwen3_tiny), dtype=torch.bfloat16, device="cuda",
                                     train_attn="flash_attention_2"))


@pytest.mark.parametrize("command", [["compare", "--infer", "hf"], ["rl", "--reward", "brackets"]])
def test_prompts_that_are_a_pipe_are_refused_before_loading(command, tmp_path):
    """Reading a FIFO waits for a writer that never comes: it is refused by its kind before anything is read."""
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)

    def hung(*args):
        raise AssertionError("the command opened the pipe and waited on it")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        result = runner.invoke(app, [*command, "--prompts", str(fifo), "--out", str(tmp_path / "out")])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert_one_error_line(result, "is not a regular file or folder", str(fifo))
    assert not (tmp_path / "out").exists()


def test_markup_in_a_message_is_printed_as_is(tmp_path):
    """A path with rich markup in it ([red]) must appear verbatim, not be eaten as a style tag."""
    missing = tmp_path / "[red]model"
    result = compare_hf(missing, tmp_path / "out")
    assert_one_error_line(result, "[red]model")


def test_signal_arriving_inside_a_finalizer_is_not_lost():
    """Python ignores an exception raised in __del__ ("Exception ignored"), so a signal that lands in a finalizer
    is raised again once it has returned, instead of being swallowed while the command runs on."""
    class Finalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10_000):  # bytecodes after the kill: the handler runs here, inside __del__
                pass

    with pytest.raises(Stopped) as stopped, stop_on_signals():
        Finalizer()  # collected at once
        time.sleep(5)  # the re-raised signal interrupts this
    assert stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handler is back


# ------------------------------------------------------------------------------------------------ subprocesses


def cli(*args, tmpdir: Path, **kwargs) -> subprocess.Popen:
    """`python -m divergence_probe ARGS` with this checkout's package and its own temp folder (vLLM's files)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "HF_HUB_OFFLINE": "1", "COLUMNS": "80"}
    env.update(kwargs.pop("env", {}))
    return subprocess.Popen([sys.executable, "-m", "divergence_probe", *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("error:", "stopped:"))]


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"ended before the signal: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def dist_files(tmpdir: Path) -> list[str]:
    return [p.name for p in tmpdir.iterdir() if p.name.startswith("vllm_dist_")]


def test_error_in_a_pipe_is_one_line(tmp_path):
    """stderr is a pipe (as in CI): no wrapping at 80 columns, however long the message."""
    deep = tmp_path / ("a-long-folder-name-" * 6) / "model"
    proc = cli("compare", "--model", deep, "--infer", "hf", "--out", tmp_path / "out", tmpdir=tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("error:") and str(deep) in err, err


@pytest.mark.slow
def test_sigterm_during_make_model_leaves_nothing(tmp_path):
    work, tmpdir = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), tmpdir.mkdir()
    proc = cli("make-model", work / "big", "--preset", "qwen2.5-0.5b", tmpdir=tmpdir)
    wait_for(lambda: any(p.name.startswith(".big.tmp-") for p in work.iterdir()), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert error_lines(err) == ["stopped: SIGTERM received; nothing was left half-written"], err
    assert list(work.iterdir()) == [], "make-model left files behind"


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, qwen3_tiny):
    out = tmp_path_factory.mktemp("runs") / "run"
    assert compare_hf(qwen3_tiny, out).exit_code == 0
    return out


def test_a_signal_that_an_import_reports_as_an_import_error_still_stops(run_folder, monkeypatch, capsys):
    """A signal that lands while a C extension module initialises (matplotlib's, as a report starts rendering)
    comes out of the import as "ImportError: initialization failed", raised from the Stopped: the command stops with
    the signal's one line and code, as anywhere else, and leaves the run folder as it was."""
    from divergence_probe import cli as cli_module
    from divergence_probe.reports import render

    def render_cut_short(*args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises Stopped here
        except Stopped as stop:
            raise ImportError("initialization failed") from stop  # what CPython makes of it in a module's init

    before = {p.name for p in run_folder.iterdir()}
    monkeypatch.setattr(render, "_render", render_cut_short)
    monkeypatch.setattr(sys, "argv", ["divergence-probe", "report", str(run_folder)])
    with pytest.raises(SystemExit) as exit_:
        cli_module.main()
    assert exit_.value.code == 128 + signal.SIGTERM
    assert error_lines(capsys.readouterr().err) == ["stopped: SIGTERM received; nothing was left half-written"]
    assert {p.name for p in run_folder.iterdir()} == before
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handler is back


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_report_leaves_nothing(signum, run_folder, tmp_path):
    before = {p.name for p in run_folder.iterdir()}
    proc = cli("report", run_folder, tmpdir=tmp_path)
    wait_for(lambda: any(p.name.startswith(".report.") and p.name not in before for p in run_folder.iterdir()), proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert error_lines(err) == [f"stopped: {signum.name} received; nothing was left half-written"], err
    assert {p.name for p in run_folder.iterdir()} == before


def _no_bigger_files_than(n_bytes: int):
    """Run in the child before exec: writes past n_bytes fail with EFBIG, as on a full disk (SIGXFSZ ignored)."""
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))
    return limit


@pytest.mark.parametrize("limit", [1_000_000, 1_000], ids=["weights", "tokenizer"])
def test_make_model_on_a_full_disk_is_one_line(limit, tmp_path):
    work, tmpdir = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), tmpdir.mkdir()
    out = work / "m"
    proc = cli("make-model", out, tmpdir=tmpdir, preexec_fn=_no_bigger_files_than(limit))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert error_lines(err) == [f"error: cannot write the model to {out}: File too large (errno 27); free space on "
                                "that disk or choose another path"], err
    assert list(work.iterdir()) == []


@pytest.mark.slow
def test_failed_vllm_start_leaves_no_dist_file(qwen3_tiny, tmp_path):
    """The engine cannot get the KV cache it is asked for: one line, and vLLM's vllm_dist_* file is removed. The
    memory plan would refuse this KV cache before vLLM starts (runs/memory.py), so the test tells the plan the
    machine has room for it: the failure is vLLM's own, at start-up."""
    proc = cli("compare", "--model", qwen3_tiny, "--device", "cpu", "--out", tmp_path / "out", tmpdir=tmp_path,
               env={"VLLM_CPU_KVCACHE_SPACE": "100000", "DIVERGENCE_PROBE_DEVICE_MEMORY": str(200_000 * 2**30)})
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, err
    [line] = error_lines(err)
    # too little memory for the KV cache: the memory plan's one line for an out-of-memory, with vLLM's reason in it
    assert line.startswith("error: out of cpu memory in starting the inference stack") and "vLLM could not start" in line, line
    assert dist_files(tmp_path) == [] and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_sigterm_with_a_live_vllm_engine_leaves_nothing(qwen3_tiny, tmp_path):
    proc = cli("compare", "--model", qwen3_tiny, "--device", "cpu", "--out", tmp_path / "out", tmpdir=tmp_path)
    wait_for(lambda: dist_files(tmp_path), proc, timeout=600)
    time.sleep(1)  # into the engine's start-up or the run
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert error_lines(err) == ["stopped: SIGTERM received; nothing was left half-written"], err
    assert dist_files(tmp_path) == [] and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["compare", "rl"])
def test_sigterm_during_the_vllm_engine_start_leaves_nothing(command, tmp_path):
    """SIGTERM while `LLM(...)` is still building the engine (tests/engine_start_driver.py holds the start at a known
    point and says so): the stop unwinds through vLLM's start-up, and the --out lock, the run folder, the folders
    made for it and vLLM's rendezvous file are all gone."""
    work, tmpdir, marker = tmp_path / "work", tmp_path / "tmp", tmp_path / "engine-starting"
    work.mkdir(), tmpdir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "HF_HUB_OFFLINE": "1", "COLUMNS": "80", "HOLD_MARKER": str(marker)}
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "engine_start_driver.py"), command, "--device", "cpu",
                             "--out", work / "new" / "run"], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    wait_for(marker.exists, proc, timeout=600)
    held = {p.relative_to(work).as_posix() for p in work.rglob("*")}  # what the run holds while the engine starts
    rl_folder = {"new/run", f"new/run/{MARK}"}  # rl claims and marks its folder before the engine starts
    assert held == {"new", "new/.run.lock"} | (rl_folder if command == "rl" else set()), held
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert error_lines(err) == ["stopped: SIGTERM received; nothing was left half-written"], err
    assert list(work.iterdir()) == [], "the lock, the run folder or the folders made for it were left"
    assert dist_files(tmpdir) == []
