"""What each side of a load takes of the run's one StackSettings: the engine's (and an ablation combination's
engine factors on it), the trainer's, and the torch dtype a dtype name loads in. Apart from the loads themselves
(runs/loading.py), so a run that only builds another engine or trainer beside the loaded ones (a combination, a remedy
arm, an alternate placement's passes) reads these without importing the load and its memory plan.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..engines.protocol import StackSettings, freeze_engine_args
from ..environment import resolve_train_device
from ..spec.load import LoadSpec

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def engine_settings(settings: StackSettings) -> StackSettings:
    """The engine's settings: the run's, without what only the training side takes."""
    return replace(settings, train_precision="bf16", train_kernels="torch", train_tp=1)


def engine_settings_for(config: LoadSpec, settings: StackSettings, load: LoadSpec) -> StackSettings:
    """The run's engine settings (`settings`, as the memory plan of `config` made them) with the engine factors of an
    ablation combination's `load`."""
    added = {k: v for k, v in load.engine_args.items() if config.engine_args.get(k) != v}
    return replace(settings, engine=load.engine, engine_args=freeze_engine_args({**settings.engine_kwargs(), **added}))


def train_settings(cfg: LoadSpec, settings: StackSettings) -> StackSettings:
    """The training stack's settings: the run's, on --train-device (the engine keeps --device)."""
    return replace(settings, device=resolve_train_device(cfg.train_device, cfg.device))
