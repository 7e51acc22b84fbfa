"""A stand-in for vLLM's v1 model runner: the real class (the engine tells runner kinds apart by class), holding only
the attributes a test gives it, so no engine is built."""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class V1Runner(GPUModelRunner):
    def __init__(self, **attrs) -> None:  # vLLM's __init__ builds the runner's buffers on a device: not wanted here
        vars(self).update(attrs)
