"""The package as pip installs it outside a checkout: the wheel pip builds from this tree, and that wheel installed
into a new virtual environment (conftest's `wheel` and `installed_env` fixtures; tests/test_packaging.py).

The new environment installs the wheel with pip, offline (`--no-index`), beside the stack this suite runs on: a
`.pth` file puts the stack's site-packages after the environment's own, so pip checks the wheel's requirements
against the locked stack (and fails, offline, if they exclude it), and a run imports the wheel's copy of the package,
not the checkout's. Nothing of the stack is downloaded or copied again: seconds, not the minutes of a set-up. The
stack's own files lie outside the new environment, where pip neither upgrades nor uninstalls anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def user_env() -> dict[str, str]:
    """The environment of a user's shell: no pip configuration but the command's own (this machine's pip.conf and
    PIP_* variables left out) and not the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1"}


def build_wheel(work: Path) -> Path:
    """The wheel pip builds from a copy of the source (a build leaves build/ and *.egg-info where it runs)."""
    source, out = work / "source", work / "wheel"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "divergence_probe", source / "divergence_probe", symlinks=True, ignore=skip)
    shutil.copytree(REPO / "docs", source / "docs", ignore=skip)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(out), str(source)], env=user_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("divergence_probe-*.whl")
    return built


def install(wheel: Path, venv: Path) -> Path:
    """A new virtual environment at `venv` with `wheel` installed beside this suite's stack; its bin/ folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    (Path(own) / "stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-compile", str(wheel)],
                          env=user_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    where = subprocess.run([python, "-c", "import divergence_probe; print(divergence_probe.__file__)"], cwd=venv,
                           env=user_env(), capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(own), f"the new environment imports {where}, not the wheel's copy"
    return venv / "bin"
