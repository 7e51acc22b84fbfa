"""The compiled tap reduction, kept per machine so that a new process loads it instead of compiling it.

torch's own caches (Inductor's FX graph cache, AOT autograd's) already keep the generated kernel across processes,
but every process still traces the function with dynamo and rebuilds the compiled frame around the cached kernel,
which was the largest cost paid again in each tapped compare after the imports (docs/results/compare-time). torch's
precompile (`torch.compile(...).aot_compile`, `save_compiled_function`, `torch.compiler.load_compiled_function`)
keeps the traced frame, its guards and the kernel together in one file; loading it skips the trace.

A saved function is one pattern of tap groups (how many, their dtypes and layouts) at any sizes, and its code was
generated for one machine's setting: every input of that code is in the key, and the key is written inside the
file and compared on loading, so nothing saved for another torch, Python, source of the reduction, Inductor
configuration, device, CPU instruction set or thread count, dtype or layout is ever used. The loaded function's
guards are still checked at each call; a call they refuse goes to the plain compiled function. A file that cannot
be read, or that torch cannot load, counts as absent: the reduction is compiled and the file written anew.

Where: reduction/ in the tool's cache folder (home.cache_home(): $DIVERGENCE_PROBE_HOME, else
$XDG_CACHE_HOME/divergence-probe, else ~/.cache/divergence-probe), never in a run folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

FORMAT = 1  # of the file: a line of the key as JSON, then torch's serialized function
PAST_LIMIT = "past the limit"  # what a Saved gives for a pattern past its limit of patterns per process


def source_digest(modules: tuple[ModuleType, ...]) -> str:
    """The reduction's code: the modules its traced function comes from and calls into."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()


def _device(device: torch.device) -> dict:
    """What the generated code was made for: the GPU's capability, or the CPU's vector instructions and the thread
    count Inductor's C++ kernels specialize on."""
    if device.type == "cuda":
        return {"type": "cuda", "capability": list(torch.cuda.get_device_capability(device)),
                "name": torch.cuda.get_device_name(device)}
    return {"type": device.type, "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}


def _layout(t: torch.Tensor, block: int) -> list:
    """What of a tensor's shape the compiled function specializes on (dynamic sizes, save 0 and 1, and the branches
    of metrics.diff_sums on rows and widths in `block`s), with its dtype and whether it is contiguous."""
    row = t.numel() // len(t) if len(t) else 0
    return [str(t.dtype), [min(size, 2) for size in t.shape], row % block == 0, t.shape[-1] % block == 0,
            t.is_contiguous()]


class Saved:
    """The saved functions of one reduction in this process: each pattern's, loaded or compiled at its first call,
    kept in `folder`. `sources`: the modules of the function's code; `block`: the row length metrics.diff_sums
    branches on.

    What the key takes from the process (torch, the source, Inductor's configuration) is read once, at the first
    call, the way the plain compiled function fixes them at its first call too."""

    def __init__(self, function, options: dict, limit: int, folder: Path, sources: tuple[ModuleType, ...],
                 block: int):
        self.function, self.options, self.limit = function, options, limit
        self.folder, self.sources, self.block = folder, sources, block
        self.fixed: dict | None = None
        self.patterns: dict[tuple, object] = {}  # (device, layouts) -> the function, or None where torch could not

    def __call__(self, tests: list[torch.Tensor], refs: list[torch.Tensor]):
        """The precompiled function for this pattern; None where torch's precompile failed; PAST_LIMIT for a new
        pattern past `limit` (the plain compiled function, which compiles only what this lets through, is then at
        most at the same count)."""
        layouts = [[_layout(t, self.block) for t in tests], [_layout(r, self.block) for r in refs]]
        pattern = (str(tests[0].device), json.dumps(layouts))
        if pattern not in self.patterns:
            if len(self.patterns) >= self.limit:
                return PAST_LIMIT
            key = self.key(tests, refs)
            if self.unloadable(key).exists():  # torch here could not load what it saved: plain compile, as before
                self.patterns[pattern] = None
            else:
                self.patterns[pattern] = self.load(key) or self.compile_and_save(tests, refs, key)
        return self.patterns[pattern]

    def key(self, tests: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
        """Everything the saved function depends on, as JSON values."""
        if self.fixed is None:
            import torch._inductor.config as inductor_config

            config = repr(sorted(inductor_config.save_config_portable().items()))
            self.fixed = {"format": FORMAT, "torch": torch.__version__, "python": sys.version,
                          "source": source_digest(self.sources), "options": self.options,
                          "inductor_config": hashlib.sha256(config.encode()).hexdigest()}
        return {**self.fixed, "device": _device(tests[0].device), "tests": [_layout(t, self.block) for t in tests],
                "refs": [_layout(r, self.block) for r in refs]}

    def path(self, key: dict) -> Path:
        return self.folder / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest() + ".bin")

    def unloadable(self, key: dict) -> Path:
        """The mark of a key whose saved function this torch, on this machine, could not load back right after
        saving it: every later process would otherwise precompile and save again, each paying more than the plain
        compile it replaces."""
        return self.path(key).with_suffix(".unloadable")

    def load(self, key: dict):
        """The saved function for this key, or None (absent, another key, unreadable)."""
        try:
            with open(self.path(key), "rb") as f:
                if json.loads(f.readline()) != key:
                    return None
                fn = torch.compiler.load_compiled_function(f)
        except Exception:  # absent, truncated, corrupt, or saved by a torch that reads it otherwise: compile anew
            return None
        fn.disable_guard_check()  # checked by the caller, which goes to the plain compiled function when they refuse
        return fn

    def compile_and_save(self, tests: list[torch.Tensor], refs: list[torch.Tensor], key: dict):
        """Compile the function for this pattern and keep it for later processes; None where torch's precompile
        cannot (the caller compiles as before). A folder that cannot be written only costs the saving."""
        try:
            fn = torch.compile(self.function, dynamic=True, fullgraph=True,
                               options=self.options).aot_compile(((tests, refs), {}))
        except Exception:  # precompile refuses this function or this torch: the plain compiled path serves it
            return None
        fn.disable_guard_check()
        path, tmp = self.path(key), None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
                tmp.write(json.dumps(key, sort_keys=True).encode() + b"\n")
                tmp.write(type(fn).serialize(fn).serialized_data)
            os.replace(tmp.name, path)  # whole or not at all: a reader meanwhile sees the old file or none
            if self.load(key) is None:  # read back once: a file this torch cannot load must not be made again
                self.unloadable(key).write_text(json.dumps(key, sort_keys=True))
                path.unlink()
        except Exception:  # a read-only or full disk, a function torch cannot serialize: this process still has it
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp.name)
        return fn
