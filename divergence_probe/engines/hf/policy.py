"""transformers' pre-load policy (engines/protocol.py StackClass): its knobs (the kernel set, the precision), its
variants (in this process, or sharded over --train-tp ranks) and what it refuses of a model before loading. Its stack
classes (trainer.py HFStack, tensor_parallel.py ShardedHFStack) inherit it. Imports no transformers.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ...errors import StackError
from ..protocol import KernelSet, Knob, StackPolicy, StackSettings
from .kernels import KERNELS, get_kernels


def _kernels_check(value: str, device: str) -> None:
    get_kernels(value).check(device)


def _no_check(value: str, device: str) -> None:
    """Checked by the LoadSpec the factor's combinations load (LoadSpec.__post_init__, RunSpec's own checks)."""


def check_shardable(config: dict, ranks: int, device: str) -> None:
    """Refuse, before anything loads, ranks on GPUs this torch does not see, and a size the plan cannot split evenly:
    whole attention and KV heads per rank (a head split over ranks would attend with half its dimensions), and the
    MLP width and vocabulary (the LM head's gather needs equal slices). `device`: the trainer's, resolved."""
    if ranks <= 1:
        return
    import torch

    last = rank_devices(device, ranks)[-1]
    if last != "cpu" and int(last.partition(":")[2]) >= torch.cuda.device_count():
        raise StackError(f"--train-tp {ranks} from {device} needs GPUs up to {last}, but this torch sees "
                         f"{torch.cuda.device_count()}; lower --train-tp or pick another --train-device")
    sizes = {"num_attention_heads": config.get("num_attention_heads"),
             "num_key_value_heads": config.get("num_key_value_heads") or config.get("num_attention_heads"),
             "intermediate_size": config.get("intermediate_size"), "vocab_size": config.get("vocab_size")}
    for field, value in sizes.items():
        if isinstance(value, int) and value % ranks:
            raise StackError(f"--train-tp {ranks} does not divide the model's {field} ({value}), which the trainer's "
                             "tensor-parallel plan splits evenly over its ranks; use a --train-tp that divides it")


def rank_devices(device: str, ranks: int) -> list[str]:
    """Each rank's device: the CPU for all, or consecutive GPUs from `device`'s index (its own checks: spec/probe)."""
    if device == "cpu":
        return ["cpu"] * ranks
    import torch

    first = torch.device(device).index
    first = torch.cuda.current_device() if first is None else first
    return [f"cuda:{first + r}" for r in range(ranks)]


class HFPolicy(StackPolicy):
    name = "hf"
    title = "transformers"
    sides = ("infer", "train")
    sdpa = True
    released = "closed: the second transformers instance was dropped in this process before the trainer loaded"
    patches = "divergence_probe.engines.hf.patches:PATCHES"
    aligns = ("rope", "swiglu", "rmsnorm", "lm_head", "residual")  # patches/: PATCHES

    @classmethod
    def knobs(cls) -> Mapping[str, Knob]:
        knobs = [Knob("train", "kernels", tuple(KERNELS), "train_kernels", lambda value, load: value, _kernels_check,
                      "the trainer's kernel set (--train-kernels)"),
                 Knob("train", "precision", ("amp", "bf16"), "train_precision", lambda value, load: value, _no_check,
                      "the trainer's precision (--train-precision)")]
        return {knob.name: knob for knob in knobs}

    @classmethod
    def kernel_sets(cls) -> tuple[str, ...]:
        return tuple(KERNELS)

    @classmethod
    def kernel_set(cls, name: str) -> KernelSet:
        return get_kernels(name)

    @classmethod
    def check_model(cls, settings: StackSettings, config: dict) -> None:
        """A sharded trainer (train_tp > 1) whose ranks this torch does not see or whose plan cannot split the
        model evenly."""
        check_shardable(config, settings.train_tp, settings.device)

    @classmethod
    def for_settings(cls, settings: StackSettings, regions: Sequence[str] | None = None):
        """In this process, or sharded over settings.train_tp ranks (a trainer's settings; an engine's have 1)."""
        from .. import stack_class

        if regions is not None:
            return super().for_settings(settings, regions)
        return stack_class(cls.name, settings.train_tp)()
