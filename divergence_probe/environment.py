"""The device choice (auto, cpu, cuda; the trainer's own), a tensor's way onto it, and vLLM's CPU KV cache setting.

The machine and library versions a run used, which every manifest records, are versions.py's `environment`."""

from __future__ import annotations

import os

import torch

from .errors import ProbeError


def to_device(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """The tensor on `device`, without making the host wait for the device.

    A copy from ordinary (pageable) host memory makes torch synchronize the stream, so the host would idle
    until every kernel queued so far has run; from pinned memory the copy is queued like a kernel."""
    if tensor.device.type == "cpu" and torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ProbeError("--device cuda, but this torch sees no CUDA GPU; use --device cpu or install CUDA torch")
    if device not in ("cpu", "cuda"):
        raise ProbeError(f"--device {device!r}; choose auto, cpu or cuda")
    return device


def resolve_train_device(train_device: str | None, device: str) -> str:
    """The training stack's device (--train-device): its own GPU (`cuda:1`), the CPU beside a GPU engine, or, when
    not given, the run's --device (its spelling is checked by spec.LoadSpec). Checked before anything loads: a device
    this machine does not have is one line."""
    if train_device is None:
        return resolve_device(device)
    if train_device == "cpu":
        return "cpu"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(train_device.partition(":")[2] or 0)
    if index >= count:
        have = f"{count} CUDA device(s) (cuda:0 to cuda:{count - 1})" if count else "no CUDA GPU"
        raise ProbeError(f"--train-device {train_device}, but this torch sees {have}; use cpu or an index it sees, "
                         "or drop --train-device")
    return train_device


def same_device(a: str, b: str) -> bool:
    """Whether two resolved devices ("cpu", "cuda", "cuda:N") are one: "cuda" is torch's current GPU."""
    if a == b:
        return True
    ta, tb = torch.device(a), torch.device(b)
    if ta.type != tb.type or ta.type != "cuda":
        return False
    current = torch.cuda.current_device()
    return (current if ta.index is None else ta.index) == (current if tb.index is None else tb.index)


CPU_KV_CACHE, CPU_KV_CACHE_DEFAULT = "VLLM_CPU_KVCACHE_SPACE", 1  # GiB: ample for a few thousand tokens of a small model


def cpu_kv_cache_gib() -> int:
    """The GiB vLLM's CPU engine gives its KV cache: VLLM_CPU_KVCACHE_SPACE read as vLLM reads it (int(): a whole
    number, `2` or `+2`, never `0.5`), CPU_KV_CACHE_DEFAULT when unset or empty. What vLLM would fail on, later and
    as a traceback (a fraction, a word, 0 or less: no KV cache), is one line before anything loads."""
    text = os.environ.get(CPU_KV_CACHE, "")
    if not text.strip():
        return CPU_KV_CACHE_DEFAULT
    try:
        gib = int(text)
    except ValueError:
        raise ProbeError(f"{CPU_KV_CACHE}={text!r} is not a whole number of GiB, which is what vLLM's CPU engine reads "
                         f"there; set it to one (e.g. {CPU_KV_CACHE}=2), or unset it for {CPU_KV_CACHE_DEFAULT} GiB") \
            from None
    if gib < 1:
        raise ProbeError(f"{CPU_KV_CACHE}={text!r} leaves vLLM's CPU engine no KV cache; set it to a whole number of "
                         f"GiB from 1 (e.g. {CPU_KV_CACHE}=2), or unset it for {CPU_KV_CACHE_DEFAULT} GiB")
    return gib
