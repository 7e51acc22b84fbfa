"""What a run measured of its memory, beside what the memory plan (runs/memory.py) expected: the allocator's peak per
phase of the run loop, what the engine reports of its weights and KV cache, and the bytes the capture really held
(`CountingCapture`, for benchmarks/memory_plan.py)."""

from __future__ import annotations


class Peaks:
    """Peak device memory per phase of the run loop (CUDA: torch's allocator, which both stacks share; vLLM's KV
    cache and weights are in it too), and of the trainer's own GPU when it has one (--train-device cuda:N). On the
    CPU no allocator keeps a peak: nothing is recorded, and benchmarks/memory_plan.py counts the tap bytes a run holds
    instead."""

    def __init__(self, device: str, train_device: str | None = None) -> None:
        self.cuda = device == "cuda"
        self.devices = ([None] if self.cuda else []) + ([train_device] if (train_device or "").startswith("cuda") else [])
        self.peaks: dict[str, int] = {}

    def start(self) -> None:
        import torch

        for device in self.devices:
            torch.cuda.reset_peak_memory_stats(device)

    def end(self, phase: str) -> None:
        import torch

        for device in self.devices:
            key = phase if device is None else f"{phase} ({device})"
            self.peaks[key] = max(self.peaks.get(key, 0), int(torch.cuda.max_memory_allocated(device)))

    def record(self) -> dict:
        if not self.devices:
            return {"device": "cpu: no allocator peak (benchmarks/memory_plan.py counts the capture's bytes)"}
        import torch

        return {"max_memory_allocated_bytes_by_phase": dict(self.peaks),
                "max_memory_reserved_bytes": int(torch.cuda.max_memory_reserved()) if self.cuda else None}


def engine_report(stack) -> dict:
    """What vLLM itself reports of its weights and KV cache (read from the live engine; absent where it keeps none)."""
    runner, llm = getattr(stack, "runner", None), getattr(stack, "llm", None)
    out = {}
    weights = getattr(runner, "model_memory_usage", None)
    if weights:
        out["weights_bytes"] = int(weights)
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        out["kv_cache_memory_bytes"] = cache.kv_cache_memory_bytes
        if cache.num_gpu_blocks:
            out["kv_blocks"], out["block_size"] = int(cache.num_gpu_blocks), int(cache.block_size)
    except AttributeError:
        pass
    return out


class CountingCapture:
    """A capture (compare.score_both's park/add_sequences/pair/finish_prompt) that files every hand-over with the real
    one and counts what the run holds, independently of the plan's arithmetic: per inference batch (a batch starts at the first park
    after a training-side finish) and per training sequence, the bytes of the tensors handed over (`taps`, `logits`)
    and of the distinct storages behind them (`storage`: a view keeps its whole buffer alive, e.g. vLLM's fused
    q/k/v output behind v_proj)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.batches: list[dict[str, int]] = []
        self.sequences: dict[int, dict[str, int]] = {}
        self._storages: dict[int, int] = {}
        self._sequence_storages: dict[int, dict[int, int]] = {}
        self._new_batch = True

    @staticmethod
    def _count(into: dict[str, int], storages: dict[int, int], name: str, x) -> None:
        if name == "logits":  # the plan's infer_logits; a sequence's logits are held with or without the tap
            into["logits"] += x.numel() * x.element_size()
            return
        into["taps"] += x.numel() * x.element_size()
        storage = x.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    def park(self, key, tap, x) -> None:
        from ..taps import each_tap

        if self._new_batch:
            self.batches.append({"taps": 0, "logits": 0, "storage": 0})
            self._storages, self._new_batch = {}, False
        for k, t in each_tap(tap, x):
            self._count(self.batches[-1], self._storages, k.name, t)
        self.batches[-1]["storage"] = sum(self._storages.values())
        self.inner.park(key, tap, x)

    def add_sequences(self, sequences) -> None:
        self.inner.add_sequences(sequences)

    def pair(self, key, tap, x) -> None:
        counts = self.sequences.setdefault(key, {"taps": 0, "logits": 0, "storage": 0})
        storages = self._sequence_storages.setdefault(key, {})
        self._count(counts, storages, tap.name, x)
        counts["storage"] = sum(storages.values())
        self.inner.pair(key, tap, x)

    def finish_prompt(self, key) -> None:
        self._new_batch = True
        self._sequence_storages.pop(key, None)
        self.inner.finish_prompt(key)

    def largest(self) -> dict[str, int]:
        """The largest batch's and the longest sequence's counts, as the plan's terms are."""
        most = lambda rows, field: max((r[field] for r in rows), default=0)  # noqa: E731
        seqs = list(self.sequences.values())
        return {"infer_taps_handed_over": most(self.batches, "taps"), "infer_taps_storage": most(self.batches, "storage"),
                "infer_logits": most(self.batches, "logits"), "train_taps_handed_over": most(seqs, "taps"),
                "train_taps_storage": most(seqs, "storage")}
