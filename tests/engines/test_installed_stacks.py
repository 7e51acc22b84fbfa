"""An engine shipped as a package of its own is found through its entry point (engines.ENTRY_POINTS), with no call
that registers it: a package installed is its metadata on the path, here a `<name>.dist-info` folder made in a temporary
folder (no pip install), whose entry point names tests/engines/second_engine/'s class. The registry reads entry
points once per process, so each test here makes it read them again (`installed`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import second_engine
from divergence_probe import engines
from divergence_probe.cli import app

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "second-engine-plugin"
BROKEN = "second_engine.missing:SecondStack"  # a module its package does not have


def distribution(folder: Path, entries: dict[str, str], package: str = PACKAGE) -> Path:
    """`folder`, holding a package as pip leaves it installed, its metadata alone: METADATA and entry_points.txt, the
    stacks in `entries` (name -> "module:Class")."""
    info = folder / f"{package.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{engines.ENTRY_POINTS}]\n"
                                           + "".join(f"{name} = {target}\n" for name, target in entries.items()))
    return folder


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """install(entries, package): that package on sys.path for this test, read by the registry from then on."""
    def install(entries: dict[str, str], package: str = PACKAGE) -> None:
        monkeypatch.syspath_prepend(str(distribution(tmp_path / package, entries, package)))
        engines._entry_points.cache_clear()

    yield install
    engines._entry_points.cache_clear()  # the next test reads the path as it finds it


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)


@pytest.mark.engine  # the tool runs in a child process
def test_compare_runs_an_engine_found_only_through_its_entry_point(qwen3_tiny, prompts_file, tmp_path):
    """A process of its own, in which nothing registers the engine: only the package's metadata names it."""
    site = distribution(tmp_path / "site", {second_engine.NAME: second_engine.TARGET})
    path = os.pathsep.join([str(site), str(ROOT / "tests" / "engines"), str(ROOT)])
    out = tmp_path / "compare"
    result = subprocess.run([sys.executable, "-m", "divergence_probe", "compare", "--model", str(qwen3_tiny),
                             "--infer", second_engine.NAME, "--prompts", str(prompts_file), "--taps", "none",
                             "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": path, "DIVERGENCE_PROBE_EAGER": "1"})
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stacks"]["infer"]["name"] == second_engine.NAME and manifest["stacks"]["train"]["name"] == "hf"


def test_the_options_and_their_error_lines_list_an_installed_stack_without_importing_it(installed):
    """Listed from the metadata alone: a stack whose module does not import is listed all the same."""
    installed({second_engine.NAME: second_engine.TARGET, "broken": BROKEN})
    shown = CliRunner().invoke(app, ["compare", "--help"], env={"COLUMNS": "400"})
    assert shown.exit_code == 0, shown.output
    assert [line.split()[1] for line in shown.output.splitlines() if "Installed: second, broken." in line] == [
        "--infer", "--train"]
    refused = cli("compare", "--infer", "nope")
    assert refused.exit_code == 2 and refused.output.strip() == (
        "error: --infer 'nope' is not valid; choose one of: vllm, hf, second, broken")


@pytest.mark.parametrize("packages, taken", [
    ({PACKAGE: {"hf": second_engine.TARGET}}, "a stack the tool ships"),
    ({PACKAGE: {"second": second_engine.TARGET}, "other-plugin": {"second": second_engine.TARGET}},
     "the stack other-plugin 0.1 adds"),  # installed last, so first on the path: found first
])
def test_a_name_taken_already_is_refused_in_one_line_for_any_run(installed, packages, taken, tmp_path, monkeypatch):
    """Even a run that never names it (--infer hf --train hf): an installed stack shadows no other, silently or not."""
    from divergence_probe.engines.hf.trainer import HFStack

    monkeypatch.setattr(HFStack, "load", lambda self, settings: pytest.fail("a stack loaded"))
    for package, entries in packages.items():
        installed(entries, package)
    name = next(iter(packages[PACKAGE]))
    result = cli("compare", "--infer", "hf", "--device", "cpu", "--taps", "none", "--out", tmp_path / "run")
    assert result.exit_code == 2 and result.output.strip() == (
        f"error: {PACKAGE} 0.1 adds a stack named {name!r} ({engines.ENTRY_POINTS} entry point), the name of {taken}; "
        "rename its entry point and its class's `name`, or uninstall it")
    assert not (tmp_path / "run").exists()


def test_an_installed_stack_that_does_not_import_is_one_line_naming_it_its_package_and_the_error(installed, tmp_path):
    installed({"broken": BROKEN})
    result = cli("compare", "--infer", "broken", "--device", "cpu", "--out", tmp_path / "run")
    assert result.exit_code == 2 and result.output.strip() == (
        f"error: the stack 'broken' that {PACKAGE} 0.1 adds did not import ({BROKEN}: ModuleNotFoundError: No module "
        "named 'second_engine.missing'); fix or reinstall that package, or uninstall it")


def test_a_side_its_class_does_not_declare_is_refused_once_it_is_chosen(installed, tmp_path):
    """Its entry point says nothing of sides: the class does (SecondStack.sides, the inference side alone)."""
    installed({second_engine.NAME: second_engine.TARGET})
    result = cli("compare", "--train", second_engine.NAME, "--device", "cpu", "--out", tmp_path / "run")
    assert result.exit_code == 2 and result.output.strip() == (
        "error: --train second: the second engine does not sit on the train side (its class's sides: infer); "
        "choose one of: hf")


class KnobbedStack(second_engine.SecondStack):
    """The second engine with one deployment knob of its own, as an installed engine may declare."""

    name = "knobbed"

    @classmethod
    def knobs(cls):
        from divergence_probe.engines.protocol import Knob

        return {"engine:speed": Knob(side="engine", key="speed", values=("fast",), field="engine_args",
                                     change=lambda value, load: {**load.engine_args, "speed": value},
                                     check=lambda value, device: None, summary="how fast the second engine runs")}


def test_an_installed_stacks_knob_is_a_factor(installed):
    installed({"knobbed": f"{__name__}:{KnobbedStack.__name__}"})
    factor = engines.parse_factor("engine:speed=fast")
    assert (factor.knob.owner, factor.label) == ("knobbed", "engine:speed=fast")


def not_a_stack():
    """What an entry point may name by mistake: a function."""


@pytest.mark.parametrize("target", [second_engine.TARGET.partition(":")[0], f"{__name__}:not_a_stack",
                                    f"{__name__}:Path"])
def test_an_entry_point_naming_no_stack_class_is_one_line(installed, target, tmp_path):
    """A module, a function, a class of another kind: each refused in one line, not read for its sides or knobs."""
    installed({"bare": target})
    result = cli("compare", "--infer", "bare", "--device", "cpu", "--out", tmp_path / "run")
    assert result.exit_code == 2 and result.output.strip() == (
        f"error: the stack 'bare' that {PACKAGE} 0.1 adds names {target}, which is not a stack class (a subclass of "
        "engines.protocol.StackPolicy); fix or reinstall that package, or uninstall it")
    assert not (tmp_path / "run").exists()


def test_an_entry_point_named_otherwise_than_its_class_is_one_line(installed, tmp_path):
    """The class names itself when its patches and variants are looked up: an entry point of another name would find
    the stack, then fail to find it again once loaded."""
    installed({"second2": second_engine.TARGET})
    result = cli("compare", "--infer", "second2", "--device", "cpu", "--out", tmp_path / "run")
    assert result.exit_code == 2 and result.output.strip() == (
        f"error: the stack 'second2' that {PACKAGE} 0.1 adds is the class {second_engine.TARGET}, whose name is "
        "'second'; an entry point's name is its class's `name`: fix or reinstall that package, or uninstall it")
    assert not (tmp_path / "run").exists()


def test_a_module_that_exits_as_it_imports_is_one_line(installed, tmp_path, monkeypatch):
    (tmp_path / "exiting_engine.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    installed({"exiting": "exiting_engine:Stack"})
    result = cli("compare", "--infer", "exiting", "--device", "cpu", "--out", tmp_path / "run")
    assert result.exit_code == 2 and result.output.strip().startswith(
        f"error: the stack 'exiting' that {PACKAGE} 0.1 adds did not import (exiting_engine:Stack: SystemExit: 3)")


class ClashingStack(second_engine.SecondStack):
    """The second engine declaring a knob of a name the shipped engine has, with values and a change of its own."""

    name = "clash"

    @classmethod
    def knobs(cls):
        from divergence_probe.engines.protocol import Knob

        return {"engine:kv_cache_dtype": Knob(side="engine", key="kv_cache_dtype", values=("fp8", "int4"),
                                              field="batch_tokens", change=lambda value, load: 1024,
                                              check=lambda value, device: None, summary="its own cache format")}


def test_a_knob_of_a_shipped_name_is_read_from_the_runs_own_engine(installed):
    """A factor is read against the run's stacks: the installed engine's knob, not the shipped engine's of that name."""
    from divergence_probe.spec import LoadSpec
    from divergence_probe.spec.knobs import applied
    from divergence_probe.spec.run import check_factor

    installed({"clash": f"{__name__}:{ClashingStack.__name__}"})
    load = LoadSpec(infer="clash", device="cpu")
    check_factor("engine:kv_cache_dtype=fp8", load)  # refused as vLLM's knob on another engine before
    assert applied(load, ["engine:kv_cache_dtype=fp8"]).batch_tokens == 1024  # its own change, not vLLM's
    with pytest.raises(engines.ProbeError, match="changes vLLM, but --infer is clash"):
        check_factor("engine:enforce_eager=false", load)  # a knob the installed engine does not have


def test_a_package_that_does_not_import_stops_only_a_run_that_asks_its_knob(installed):
    installed({"broken": BROKEN})
    assert engines.parse_factor("train:kernels=vllm").knob.owner == "hf"  # a shipped knob: no installed class read
    with pytest.raises(engines.StackError, match="the stack 'broken'"):
        engines.parse_factor("engine:speed=fast")  # a knob no shipped stack has: the installed ones are read


def test_one_entry_point_listed_twice_by_its_package_is_one_stack(installed, tmp_path):
    """A package whose metadata lists the same entry point twice does not clash with itself."""
    installed({second_engine.NAME: second_engine.TARGET})
    listed = next((tmp_path / PACKAGE).glob("*.dist-info")) / "entry_points.txt"
    listed.write_text(listed.read_text() + f"{second_engine.NAME} = {second_engine.TARGET}\n")
    engines._entry_points.cache_clear()
    assert len([e for e in engines._entry_points() if e.name == second_engine.NAME]) == 2
    assert list(engines.installed_stacks()) == [second_engine.NAME]
