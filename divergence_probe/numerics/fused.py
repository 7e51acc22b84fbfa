"""metrics.diff_sums as one fused kernel: the reduction of tap pairs, on the device that holds them.

Run eagerly, diff_sums makes ~20 passes over each tap (casts, products, seven reductions), which made the
reduction the largest cost of a tapped compare. torch.compile fuses it into one read of both tensors
(C++/OpenMP on CPU, Triton on CUDA; docs/benchmarks.md has the speed-up). It is compiled once per process with dynamic
shapes: one graph per pattern of a prompt's groups (how many, their dtypes, whether rows are multiples of 64),
whatever the sizes; a compare has one pattern. Up to PATTERN_LIMIT patterns per process are compiled; a pattern
past that runs eagerly, and `backend()` says so (torch's own limit, 8, would switch to eager silently). Each pattern's
compiled function is kept per machine and loaded by later processes (numerics/reduction_cache.py).

The float sums' last bits depend on the kernel's summation order (eager vs compiled, and the kernel inductor
generates for a pattern), so they are reproducible for the same inputs and options, not across tap selections.
Counts and maxima are exact either way.
Where compiling fails (no C compiler, an unsupported backend) the same function runs eagerly, with one warning;
`backend()` names the path for the manifest. DIVERGENCE_PROBE_EAGER=1 forces the eager path.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

from .. import timings
from ..home import cache_home
from .metrics import diff_sums

_compiled = None  # the compiled diff_sums, while compiling works
_backend: str | None = None  # None until the first pair is reduced
PATTERN_LIMIT = 64  # compiled graphs of the reduction per process (a notebook may try many tap selections)
_PAST_LIMIT = f"; patterns past {PATTERN_LIMIT} per process ran eagerly"


def backend() -> str | None:
    """How tap pairs were reduced in this process so far: 'torch.compile (inductor, ...)' or 'eager (why)'."""
    return _backend


def diff_sums_of_groups(tests: list[torch.Tensor], refs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([diff_sums(test, ref) for test, ref in zip(tests, refs)])


def saved_reductions(options: dict):
    """This process's saved reductions (numerics/reduction_cache.py), in reduction/ of the tool's cache folder."""
    from . import metrics
    from .reduction_cache import Saved

    return Saved(diff_sums_of_groups, options, PATTERN_LIMIT, cache_home() / "reduction",
                 (sys.modules[__name__], metrics), metrics._BLOCK)


def _compile():
    """The compiled reduction and its description for the manifest.

    Inductor picks among several configurations of a reduction kernel by timing them on the device at the first
    launch; two configurations sum in different orders, so the float sums' last bits could differ from process
    to process. Its deterministic mode (torch >= 2.9 or so) takes the choice without timing: same inputs, same
    sums, in every run, at a small cost (docs/results/h200/qwen2.5-1.5b-perf/reduction-modes.json).

    The returned function gives None for a pattern past PATTERN_LIMIT, where dynamo would otherwise fall back to
    eager without a word (torch >= 2.7 names these settings; older ones keep torch's silent limit of 8).

    Each pattern's function is first looked up in this machine's cache (numerics/reduction_cache.py), which skips
    dynamo's trace in every process after the first; the plain compiled function serves whatever the cache cannot
    (torch's precompile refused, or the saved function's guards refuse a call)."""
    import torch._inductor.config as inductor_config

    from .reduction_cache import PAST_LIMIT

    if hasattr(inductor_config, "deterministic"):
        options = {"deterministic": True}
        description = "torch.compile (inductor, deterministic)"
    else:
        options = {}
        description = ("torch.compile (inductor; kernel configs timed per process: GPU sums may differ in the "
                       "last bits between runs)")
    compiled = torch.compile(diff_sums_of_groups, dynamic=True, options=options)
    saved = saved_reductions(options)
    dynamo = torch._dynamo.config
    # suppress_errors (set globally by some libraries) may not be on together with fail_on_recompile_limit_hit
    limits = ({"recompile_limit": PATTERN_LIMIT, "fail_on_recompile_limit_hit": True, "suppress_errors": False}
              if hasattr(dynamo, "fail_on_recompile_limit_hit") else {})
    limit_hit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())

    # Without duck sizing: dynamo would otherwise give two dimensions that happen to be equal in the first call
    # (a prompt's token count and a head's width, say) one symbol, and compile again for every prompt where they
    # differ.
    from torch.fx.experimental import _config as shape_config

    def reduce(tests, refs):
        try:
            with dynamo.patch(**limits), shape_config.patch(use_duck_shape=False):
                precompiled = saved(tests, refs)
                if precompiled is PAST_LIMIT:
                    return None
                if precompiled is not None and precompiled.guard_check(tests, refs):
                    return precompiled(tests, refs)
                return compiled(tests, refs)
        except limit_hit:
            return None

    return reduce, description


def fused_diff_sums(tests: list[torch.Tensor], refs: list[torch.Tensor]) -> torch.Tensor:
    """diff_sums of every pair (tests[i], refs[i]), concatenated, fused where possible; the caller has checked
    shapes and dtypes. One call for all of a prompt's groups: each compiled call costs the host its guards and
    bookkeeping, which dominated the reduction's cost on a GPU when it was made once per group
    (benchmarks/tap_anatomy.py measures it)."""
    global _compiled, _backend
    first = _backend is None
    if first:
        if os.environ.get("DIVERGENCE_PROBE_EAGER") == "1":
            _backend = "eager (DIVERGENCE_PROBE_EAGER=1)"
        else:
            _compiled, _backend = _compile()
    if _compiled is not None:
        try:
            # the first call traces and compiles the pattern (or loads it from torch's caches)
            with timings.timed("run.score.train.reduction.first_call") if first else contextlib.nullcontext():
                sums = _compiled(tests, refs)
            if sums is not None:
                return sums
            if not _backend.endswith(_PAST_LIMIT):  # this pattern only: the compiled ones stay compiled
                _backend += _PAST_LIMIT
                warnings.warn(f"more than {PATTERN_LIMIT} tap-group patterns in this process: new ones are reduced "
                              "eagerly (same statistics; float sums may differ in the last bits)", RuntimeWarning,
                              stacklevel=2)
        except RuntimeError as e:  # compiling fails at a call: dynamo, inductor and a missing C compiler raise these
            _compiled = None
            _backend = f"eager (torch.compile failed: {type(e).__name__})"
            first_line = (str(e).splitlines() or [""])[0][:200]
            warnings.warn(f"torch.compile of the tap reduction failed ({type(e).__name__}: {first_line}); "
                          "reducing eagerly: same statistics, several times slower", RuntimeWarning, stacklevel=2)
    return diff_sums_of_groups(tests, refs)
