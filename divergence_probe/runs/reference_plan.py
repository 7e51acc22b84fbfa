"""--reference in the memory plan (runs/memory.py): where the run fits without its reference, or with a float32 one,
and not as asked, the one line that says so, before anything loads. What the reference holds and its forward's peak
are the plan's terms (numerics/reference.reference_terms); the reference itself is runs/reference.py."""

from __future__ import annotations

from dataclasses import replace

from ..errors import DeviceMemoryError
from ..models.size import gib
from .memory import MemoryPlan, check, longest_sequence, placed


def check_planned(p: MemoryPlan, asked: str = "auto", can_alternate: bool = True) -> MemoryPlan:
    """The memory plan's check (runs/memory.py: the plan if it fits, else one line), before anything loads; where the
    run, placed as `asked` (memory.placed), fits without its --reference or with float32 and not as asked, the line
    is the reference's. The reference is on the trainer's device, and so is what does not fit."""
    i = p.inputs
    fitting = [] if p.fits or i.reference is None else [
        r for r in ("float32", None)
        if r != i.reference and placed(replace(i, reference=r), asked, can_alternate)[0].fits]
    if not fitting:
        return check(p)
    needed, device, free, source, terms = (p.needed, i.device, i.free_bytes, i.free_source, p.terms) \
        if i.train_device is None else \
        (p.train_needed, i.train_device, i.train_free_bytes, i.train_free_source, p.train_terms)
    beside = "beside the trainer, one stack at a time (--placement alternate)" if i.alternate else \
        "beside both stacks" if i.train_device is None else "beside the trainer (--train-device)"
    options = [f"--reference {r} (fits)" if r else "no --reference (fits)" for r in fitting]
    if i.batch_tokens_fixed:
        options.append("a lower --batch-tokens")
    if i.train_device is not None:
        options.append("another --train-device")
    elif device == "cpu":
        options.append("a machine with more memory")
    else:
        options.append("the trainer and the reference on a GPU of their own (--train-device cuda:1)")
    reference = sum(v for k, v in terms.items() if k.startswith("reference_"))  # numerics/reference.reference_terms
    raise DeviceMemoryError(
        f"--reference {i.reference} needs about {gib(reference)} of {device} memory {beside}, and the run's peak with "
        f"it is about {gib(needed)} (batch_tokens {p.batch_tokens}, longest sequence "
        f"{longest_sequence(i, p.batch_tokens)} tokens) but {gib(free)} is free ({source}); nothing was loaded. "
        f"Options: {'; '.join(options)}")
