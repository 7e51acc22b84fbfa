"""The comparison that proves a weight push, engine-neutral: the trainer's tensors mapped as an engine's loader maps
them, compared exactly with what the engine computes with, where both live (on the device, no host round trip).

An engine reads back what it computes with (engines/vllm/weights.py for vLLM) and says how its loader builds each
tensor from the trainer's (fused modules, a tied head, experts); this module pairs them, compares them and says
which tensor is not the trainer's. A fused tensor is compared source by source, each trainer tensor against its rows
of the engine's (a view), so the check copies no weight. Tensors of one dtype on both sides must be equal element
for element; where the dtypes differ both are compared as float32 (exact for BF16/FP16), so an engine that keeps a
bias in FP32 still matches. A mismatch raises SyncError naming the tensor: a wrong weight is a broken run, not a
metric. An audit also compares per-tensor sha256 of the bytes on the host, the same comparison through an
independent path. Which tensors changed since the previous check is read from each tensor's float64 L1 and L2 norms
(a diagnostic, not a proof: the equality is).
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

import torch

from ..errors import SyncError


def checksum(t: torch.Tensor, as_float32: bool = False) -> str:
    """sha256 of the tensor's bytes, or of its values as float32 bytes (exact for BF16, FP16 and FP32: the widening
    keeps every bit, so two tensors of one dtype hash alike either way; float32 only to compare across dtypes)."""
    t = t.detach().float() if as_float32 else t.detach()
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).cpu().numpy()).hexdigest()


def digests(have: torch.Tensor, want: torch.Tensor) -> tuple[str, str]:
    """Checksums of two tensors that are equal iff their values are: raw bytes when the dtypes match, float32 values
    when they differ (e.g. a bias the engine keeps in FP32 against the trainer's BF16)."""
    widen = have.dtype != want.dtype
    return checksum(have, widen), checksum(want, widen)


def same_values(have: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Whether two tensors of one shape hold the same values, as a bool on the device (read it back with others at
    once): element for element in one dtype, as float32 across dtypes (exact for BF16/FP16)."""
    if want.device != have.device:
        want = want.to(have.device)
    if have.dtype != want.dtype:
        have, want = have.float(), want.float()
    return (have == want).all()


def differing(have: list[torch.Tensor], want: list[torch.Tensor], chunk_bytes: int = 1 << 28) -> list[int]:
    """Indices of the pairs (same shapes, dtypes and device) whose values differ, in a few multi-tensor kernels and
    one read-back instead of a comparison per tensor: a weight check is hundreds of tensors, and per-tensor kernels
    made it launch-bound. The fast path is the float64 norm of each difference (`have - want` is exactly 0 where
    the values are equal, and a nonzero difference of two finite floats never rounds to 0 with subnormals, which
    torch keeps); a pair it flags is then decided by `same_values`, so the verdict is exactly element-wise `==`
    (inf - inf is NaN there, yet equal). Differences are made `chunk_bytes` at a time, to bound the memory."""
    norms, group, size = [], [], 0
    for i in range(len(have)):
        group.append(i)
        size += have[i].numel() * have[i].element_size()
        if size >= chunk_bytes or i == len(have) - 1:
            diffs = torch._foreach_sub([have[j] for j in group], [want[j] for j in group])
            norms += torch._foreach_norm(diffs, 2, dtype=torch.float64)
            del diffs
            group, size = [], 0
    if not norms:
        return []
    flagged = [i for i, n in enumerate(torch.stack(norms).tolist()) if n != 0]
    return [i for i in flagged if not bool(same_values(have[i], want[i]))]


def fingerprints(tensors: list[torch.Tensor]) -> list[tuple[float, float]]:
    """Per tensor, its L1 and L2 norms accumulated in float64 without a widened copy, in two multi-tensor kernels and
    one read-back (the L1 norm stands in for the signed sum, which torch has no multi-tensor kernel for: it took one
    launch per tensor; either is a diagnostic of change, not a proof)."""
    if not tensors:
        return []
    norms = [torch._foreach_norm(tensors, order, dtype=torch.float64) for order in (1, 2)]
    return [tuple(pair) for pair in torch.stack([torch.stack(n) for n in norms], dim=1).tolist()]


def expected_tensors(trainer: dict[str, torch.Tensor], engine_names: Iterable[str], packed: dict[str, Sequence[str]],
                     tied_head: tuple[str, str] | None,
                     loaded_from: dict[str, str] | None = None) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """engine name -> the trainer's (name, tensor) pairs the engine's loader builds it from, in the order it stacks them
    along the first dimension (one pair for a tensor loaded as it is). The parts, not their concatenation: the check
    compares each against its rows of the engine's tensor (views), so it copies no weight. `packed`: fused module ->
    the trainer's modules stacked into it (`StackLayout.packed`); `tied_head`: (head, embedding) when the head is tied
    (`Family.tied_head`), else None; `loaded_from`: engine name -> the one trainer tensor loaded into it as it is,
    under another name (a MoE's experts: `expert_sources`)."""
    out = {}
    used: set[str] = set()
    loaded_from = loaded_from or {}
    for name in engine_names:
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if name in loaded_from:  # w13_weight <- gate_up_proj: vLLM's MoE loader, not packed_modules_mapping
            sources = [loaded_from[name]]
        elif last in packed:  # qkv_proj <- q_proj, k_proj, v_proj (stacked along the output dim, in this order)
            sources = [f"{parent}.{part}.{leaf}" for part in packed[last]]
        elif tied_head and name == tied_head[0] and name not in trainer:
            sources = [tied_head[1]]
        else:
            sources = [name]
        missing = [s for s in sources if s not in trainer]
        if missing:
            raise SyncError(f"weight sync: the engine holds {name} but the trainer has no {missing[0]}; the trainer "
                            "and the engine load different architectures: point both at the same checkpoint")
        used.update(sources)
        out[name] = [(s, trainer[s]) for s in sources]
    unused = sorted(set(trainer) - used)
    if unused:
        raise SyncError(f"weight sync: the trainer's {unused[0]} has no counterpart in the engine; the trainer and the "
                        "engine load different architectures: point both at the same checkpoint")
    return out


def compare(held: dict[str, torch.Tensor], want: dict[str, list[tuple[str, torch.Tensor]]],
            audit: bool = False) -> list[torch.Tensor]:
    """Raise SyncError naming the first engine tensor (`held`: engine name -> what it computes with) that is not the
    trainer's (`want`: `expected_tensors`, in the layout the engine computes with), compared on the device (and with
    `audit`, by sha256 on the host too). Returns the engine's tensors compared (vocabulary padding rows cut), for
    `fingerprints`."""
    pairs, haves, needs, whole = [], [], [], []
    for name, tensor in held.items():
        parts = want[name]
        sources = " + ".join(source for source, _ in parts)
        sizes = [part.shape[0] for _, part in parts]
        stacked = (sum(sizes), *parts[0][1].shape[1:])  # the shape the engine's loader stacks them into
        if tensor.shape[0] > stacked[0] and tensor.shape[1:] == stacked[1:]:
            tensor = tensor[: stacked[0]]  # vocabulary padding rows: never loaded, never sampled
        views = tensor.split(sizes) if tensor.shape == stacked else ()  # each source's rows: views, no copy
        if not views or any(view.shape != part.shape for view, (_, part) in zip(views, parts)):
            shapes = " + ".join(str(tuple(part.shape)) for _, part in parts)
            raise _not_the_trainers(name, sources, f"shapes {tuple(tensor.shape)} vs {shapes}")
        for have, (_, need) in zip(views, parts):
            if audit:
                digest, expected = digests(have, need)
                if digest != expected:
                    raise _not_the_trainers(name, sources, f"sha256 {digest[:12]} vs {expected[:12]} on the host")
            if need.device != have.device:
                need = need.to(have.device)
            if need.dtype != have.dtype:  # e.g. a bias the engine keeps in FP32: compared as float32 values
                have, need = have.float(), need.float()
            pairs.append((name, sources))
            haves.append(have)
            needs.append(need)
        whole.append(tensor)
    for i in differing(haves, needs)[:1]:
        name, sources = pairs[i]
        raise _not_the_trainers(name, sources, "values differ on the device")
    return whole


def _not_the_trainers(name: str, sources: str, how: str) -> SyncError:
    return SyncError(f"weight sync: the engine's {name} is not the trainer's {sources} ({how}); the push missed, "
                     "renamed or cast it: push every trainer tensor under its checkpoint name")
