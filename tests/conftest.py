"""Shared fixtures: tiny Qwen2/Qwen3 checkpoints built once per session, and one loaded Probe per stack pair.

vLLM's CPU backend can host one engine per process, so every in-process vLLM test shares the session's
`vllm_probe` (tiny Qwen3); Qwen2 through vLLM runs in a subprocess (test_compare_cli.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # CI has no model hub; a hub lookup must fail fast, not hang
# Under pytest-xdist the workers split the cores between them, and the tools they start in child processes inherit
# that share, so that workers and their children do not oversubscribe the machine.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import torch  # noqa: E402  (after OMP_NUM_THREADS: torch reads it when imported)

if _WORKERS > 1:  # in case a plugin imported torch first
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import divergence_probe as dp  # noqa: E402
from divergence_probe.models.modelzoo import make_model  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

# The tests mirror the package's folders; a module shares its helpers with tests in other folders by its name (each
# test module's name is unique), so every folder is importable however few of them a run collects. The helpers at
# tests/ itself (toy_stack, the drivers) are importable as this file's folder.
sys.path[1:1] = sorted({str(path.parent) for path in TESTS.rglob("test_*.py")} - {str(TESTS)})


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


COLLECTED_MODULES = pytest.StashKey[set]()

# Session fixtures that start an engine: a test using one is marked `engine` without saying so itself.
ENGINE_FIXTURES = frozenset({"vllm_probe", "cli_processes"})


# The modules whose tests use `cli_processes`, whose engine processes should start once per test run: under
# pytest-xdist's `--dist loadfile` they are one unit of work, on one worker (collection refuses a module missing here).
SHARED_PROCESS_MODULES = frozenset({"test_compare_cli", "test_ablation", "test_reproducible", "test_readme",
                                    "test_packaging", "test_placement"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if ENGINE_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.engine)
        if "cli_processes" in item.fixturenames and item.module.__name__ not in SHARED_PROCESS_MODULES:
            raise pytest.UsageError(f"{item.nodeid} uses cli_processes: add its module to conftest's "
                                    "SHARED_PROCESS_MODULES")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in the process that hands out the tests
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (a module's tests on one worker: its module fixtures are built once, its tests keep their
    order), with the modules of SHARED_PROCESS_MODULES as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedProcessModules(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "cli_processes" if Path(path).stem in SHARED_PROCESS_MODULES else path

    return SharedProcessModules(config, log)


def pytest_collection_finish(session):
    session.config.stash[COLLECTED_MODULES] = {item.module.__name__ for item in session.items}  # after `-m`, `-k`


def _runs_the_tool(args) -> bool:
    """Whether a child process's command line runs divergence-probe, which may start an engine or compile: the CLI
    (by its script or `-m divergence_probe`), one of the tests' driver scripts or a benchmark, which call its API;
    `--help` starts none. A `python -c` snippet is not read: the few tests that use one import the package for a
    helper, not a run."""
    words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    words = [os.fsdecode(w) if isinstance(w, (bytes, os.PathLike)) else str(w) for w in words]
    if "--help" in words:
        return False
    named = any(Path(w).name in ("divergence-probe",) or w.endswith(("_driver.py", "_runs.py"))
                or (w.endswith(".py") and Path(w).parent.name == "benchmarks") for w in words)
    as_module = any(a == "-m" and b == "divergence_probe" for a, b in zip(words, words[1:]))
    return named or as_module


_unmarked_test: list = []  # while a test without the `engine` marker runs: how to refuse what it must not do
_TORCH_COMPILE = torch.compile  # the real one: the guard below stands in for it while an unmarked test runs


@pytest.fixture(autouse=True)
def engine_marker_is_honoured(request, monkeypatch):
    """A test that starts a vLLM engine or compiles with torch.compile, in this process or in a child running the
    tool, must carry the `engine` marker, so that `pytest -m "not engine"` is the quick pure-Python layer it promises
    to be. torch.compile compiles at a compiled function's first call, so that call is refused, not the wrapping (a
    library may wrap its functions when imported); the tap reduction keeps what it compiled for the process, so an
    unmarked test starts from an uncompiled one, refused whichever tests ran before it."""
    if request.node.get_closest_marker("engine"):
        yield
        return
    import subprocess

    from divergence_probe.engines.vllm.stack import VLLMStack
    from divergence_probe.numerics import fused

    def refuse(what):
        pytest.fail(f"{request.node.nodeid} {what} but is not marked `engine`: add @pytest.mark.engine "
                    f"(or pytestmark for the module)", pytrace=False)

    def load(self, settings):
        refuse("starts a vLLM engine")

    popen_init = subprocess.Popen.__init__

    def start_child(self, args, *rest, **kwargs):
        if _runs_the_tool(args):
            refuse("runs divergence-probe in a child process")
        popen_init(self, args, *rest, **kwargs)

    def compile_(model=None, **kwargs):
        if model is None:  # @torch.compile(...) as a decorator
            return lambda fn: compile_(fn, **kwargs)
        compiled = _TORCH_COMPILE(model, **kwargs)

        def call(*args, **kw):
            if _unmarked_test:
                _unmarked_test[-1]("compiles with torch.compile")
            return compiled(*args, **kw)

        return call

    monkeypatch.setattr(VLLMStack, "load", load)
    monkeypatch.setattr(subprocess.Popen, "__init__", start_child)
    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(fused, "_compiled", None)
    monkeypatch.setattr(fused, "_backend", None)
    _unmarked_test.append(refuse)
    yield
    _unmarked_test.pop()


@pytest.fixture(scope="session", autouse=True)
def early_engine_builds(request):
    """The slowest engine builds, started when the session begins if their module's tests were collected: a vLLM CPU
    engine serves on one thread, so on the CI's two cores they run beside the tests before them."""
    started = []
    # Under pytest-xdist every worker runs this fixture while only one runs the module, and the other worker keeps
    # the second core busy: the module builds when its tests run.
    if _WORKERS == 1 and "test_compiled_align" in request.config.stash.get(COLLECTED_MODULES, set()):
        import test_compiled_align

        started.append(test_compiled_align.start_builds(request.getfixturevalue("qwen3_tiny"),
                                                        request.getfixturevalue("prompts_file"),
                                                        request.getfixturevalue("tmp_path_factory")))
    yield
    for proc in started:  # a session stopped early leaves no engine behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def qwen3_tiny(models_dir) -> Path:
    return make_model(models_dir / "qwen3-tiny", arch="qwen3", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def qwen2_tiny(models_dir) -> Path:
    return make_model(models_dir / "qwen2-tiny", arch="qwen2", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def qwen3_moe_tiny(models_dir) -> Path:
    """A tiny Qwen3-MoE (32 experts, top-4, 2 layers): the MoE family's tests share it."""
    return make_model(models_dir / "qwen3-moe-tiny", arch="qwen3_moe", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    """Three short, varied prompts: enough to exercise batching and mapping, cheap enough for CI."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text(
        "The quick brown fox jumps over the lazy dog, and then it rests.\n\n"
        "def add(a, b):\n    return a + b  # small code prompt\n\n"
        "Die Rundung in BF16 verliert Stellen: 1 + 2**-9 == 1.\n"
    )
    return path


@pytest.fixture(scope="session")
def vllm_probe(qwen3_tiny):
    """The one vLLM engine of this test process (tiny Qwen3, BF16, CPU)."""
    probe = dp.load(str(qwen3_tiny), infer="vllm", dtype="bfloat16", device="cpu")
    yield probe
    probe.close()


@pytest.fixture(scope="session")
def hf_probe(qwen3_tiny):
    """Two independent transformers instances of the same checkpoint: the zero baseline."""
    probe = dp.load(str(qwen3_tiny), infer="hf", dtype="bfloat16", device="cpu")
    yield probe
    probe.close()


@pytest.fixture
def toy():
    """The toy stacks (`toy`, `toy-fused`), region (`toy-align`) and its patches of tests/toy_stack.py, registered
    through the same registries as the shipped ones for the duration of a test."""
    from divergence_probe.regions import REGIONS
    from divergence_probe.engines import register_stack

    removers = [register_stack("toy", "toy_stack:ToyStack"), register_stack("toy-fused", "toy_stack:FusedToyStack")]
    REGIONS["toy-align"] = "toy_stack:TOY_ALIGN"
    try:
        yield
    finally:
        REGIONS.pop("toy-align")
        for remove in removers:
            remove()


_DRIVER = """
import json, sys
from divergence_probe.cli import app
for name, args in json.loads(sys.argv[1]):
    sys.argv = ["divergence-probe", *args]  # what the manifest records as the command line
    code = app(args, standalone_mode=False)
    if code:
        sys.exit(f"{name} exited with {code}")
"""


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from this tree (packaging_env.py)."""
    from packaging_env import build_wheel

    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def installed_env(tmp_path_factory, wheel) -> Path:
    """The bin/ folder of a new virtual environment with the wheel installed, offline, beside this suite's stack
    (packaging_env.py): the package as a user has it after `pip install`, outside a checkout."""
    from packaging_env import install

    return install(wheel, tmp_path_factory.mktemp("installed") / "venv")


@pytest.fixture(scope="session")
def cli_processes(tmp_path_factory, qwen2_tiny, prompts_file, installed_env) -> dict[str, dict[str, Path]]:
    """CLI runs that need engines of their own, in three new processes started together (vLLM's CPU backend hosts
    one engine per process; one engine serves every run of its process):
    "a" and "b" run the same Qwen2 compare (every tap) and generate-mode compare, and "a" ablates Qwen2; "a" with
    an empty torch.compile cache of its own, so that its tap reduction is compiled anew;
    "builtin" runs the README's recipes on the built-in trained model (readme_runs.RUN: an ablation and three
    compares on one engine) as a user who installed the wheel would: from the new environment of `installed_env`,
    in an empty folder. Returns {process: {run: run dir}}."""
    import json
    import subprocess
    import sys

    from packaging_env import user_env
    from readme_runs import builtin_commands

    model = ["--model", str(qwen2_tiny), "--prompts", str(prompts_file), "--device", "cpu"]
    commands = {
        "prefill": ["compare", *model, "--taps", "all"],
        "generate": ["compare", *model, "--num-prompts", "2", "--taps", "none", "--mode", "generate",
                     "--max-new-tokens", "8", "--samples-per-prompt", "2", "--temperature", "0.7", "--top-p", "0.9"],
        "ablate": ["ablate", *model, "--num-prompts", "1", "--bootstrap", "50"],
        **builtin_commands(),  # README recipes on the built-in model (tests/readme_runs.py)
    }
    root = tmp_path_factory.mktemp("processes")
    procs, runs = {}, {}
    for name, plan in (("a", ["prefill", "generate", "ablate"]), ("b", ["prefill", "generate"]),
                       ("builtin", list(builtin_commands()))):
        runs[name] = {run: root / name / run for run in plan}
        argv = [(run, [*commands[run], "--out", str(runs[name][run])]) for run in plan]
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
        python, cwd = sys.executable, root
        if name == "a":  # compiles the reduction anew; "b" finds it in the user's cache, or compiles it there
            env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "empty-inductor-cache")
        if name == "builtin":  # the installed wheel, outside the checkout
            python, cwd, env = installed_env / "python", root / "empty", user_env()
            cwd.mkdir()
        procs[name] = subprocess.Popen([python, "-c", _DRIVER, json.dumps(argv)], cwd=cwd, env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=1200)
        assert proc.returncode == 0, f"process {name} failed:\n{err[-3000:]}"
    return runs


@pytest.fixture
def nan_on_forward(monkeypatch):
    """nan_on_forward(n): from now on, the n-th forward of a transformers model loaded by a stack returns NaN
    logits (counted over both stacks): a run that fails midway, after some prompts were scored and reduced."""
    from divergence_probe.engines.hf.trainer import HFStack

    calls = {"n": 0, "fail_at": None}
    real_load = HFStack.load

    def poison(module, args, output):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            output.logits.fill_(float("nan"))
        return output

    def load(self, settings):
        real_load(self, settings)
        self.model.register_forward_hook(poison)

    monkeypatch.setattr(HFStack, "load", load)

    def arm(n: int) -> dict:
        calls["fail_at"] = n
        return calls

    return arm
