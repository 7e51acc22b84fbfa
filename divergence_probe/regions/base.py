"""The Region type: an aligned reference implementation and what it aligns, engine-neutral.

"Aligned" (docs/numerics.md) means: keep the region's intermediates in FP32 and round once, to
nearest even, at the region's output. The same aligned function runs on every engine, so a region patched
on both sides maps bitwise-equal inputs to bitwise-equal outputs, whatever each engine shipped. Where each engine
takes the patch is that engine's (engines/<engine>/patches/, applied by engines/patching.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Region:
    name: str
    summary: str  # one line for --help and the README: what changes and where it rounds
    # not a patch: the trainer takes this from the engine's run of the same sequences, which the run loop wires
    # (routing replay); `aligned`/`plan` leave it to the run loop
    from_engine: bool = False
    # whether a model family's layers have this region (None: every family's do); models/ describes the family
    exists_in: Callable[[object], bool] | None = None
    # the region's code runs after the network's forward (the logits: vLLM's `compute_logits` is eager), so a
    # compiled engine calls the patch at every step and its build has no trace of it to prove
    outside_graph: bool = False
    # regions whose patch of a target this region's patch of that target includes (residual's norms are rmsnorm's
    # aligned norm fed from the FP32 stream): aligned together, this region's replacement of a shared target is the
    # one applied, and the other's other targets are patched as usual
    supersedes: tuple[str, ...] = ()
