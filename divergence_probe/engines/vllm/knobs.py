"""The engine's deployment knobs: engine args that change its numerics (FP8 KV cache, FP8 weights, the engine mode),
what each needs, and what the taps mean under them.

RL frameworks ship FP8 rollouts against a BF16 trainer. The engine checks these args itself, before anything loads
(`check_knobs`): a setting this build or device cannot run is one line, not a failure minutes into an engine
start. It also says what a tap means under a quantized engine (`tap_meanings`), so that a tensor computed from
quantized values is never reported as the same quantity as the trainer's BF16 one without saying so. Imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ...errors import ProbeError
from ..needs import Needs


@dataclass(frozen=True)
class EngineKnob:
    """One engine arg the tool measures, declared whole: what it takes, what it needs, and what an ablation factor of
    it changes in the run's load settings (spec/knobs.py makes every entry of KNOBS a factor, `engine:KEY=VALUE`)."""

    key: str  # the vllm.LLM keyword
    values: tuple[str, ...]  # the settings the tool measures
    summary: str
    needs: Needs = field(default_factory=Needs)  # the devices whose build runs these settings, a package vLLM imports
    default: str | None = None  # the engine's own setting: a factor names only the others
    load_field: str = "engine_args"  # the LoadSpec field a factor changes: the engine args, or a field of its own
    setting: Callable[[str], object] | None = None  # a value -> that field's value, where it is not an engine arg
    meanings: Callable[[str], dict[str, str]] | None = None  # a value -> tap -> what the tap is under it; set for a
    # knob that quantizes something (its settings other than `default` are checked before loading: `quantized`)

    @property
    def factor_values(self) -> tuple[str, ...]:
        return tuple(value for value in self.values if value != self.default)

    def change(self, value: str, load) -> object:
        """The factor's value -> the new value of `load_field` of the LoadSpec `load`."""
        return self.setting(value) if self.setting is not None else {**load.engine_args, self.key: value}

    def check(self, value: str, device: str) -> None:
        """An engine arg is checked by the engine (`check_knobs`); a field of its own by the LoadSpec the factor's
        combinations load."""
        if self.setting is None:
            check_knobs({self.key: value}, device)


def _kv_cache_meanings(dtype: str) -> dict[str, str]:
    return {"k_rope": f"the key before the engine writes it to its {dtype} KV cache",
            "attn_core": f"attention over keys and values read back from the {dtype} KV cache"}


def _gemm_meanings(quantization: str) -> dict[str, str]:
    return {tap: f"the output of a {quantization} GEMM ({quantization} weights and activations, output in the run's "
                 "dtype)" for tap in ("q_proj", "k_proj", "v_proj", "attn_out", "gate_proj", "up_proj", "mlp_out")}


FP8_KV = ("fp8", "fp8_e4m3", "fp8_e5m2")
KNOBS: dict[str, EngineKnob] = {
    "kv_cache_dtype": EngineKnob("kv_cache_dtype", ("auto", *FP8_KV),
                                 "the KV cache's dtype: fp8 stores keys and values in FP8 (attention reads them back "
                                 "dequantized)", Needs(devices=("cuda",)), default="auto",
                                 meanings=_kv_cache_meanings),
    "quantization": EngineKnob("quantization", ("fp8",),
                               "weights quantized on load (fp8: per-tensor FP8 weights, dynamic FP8 activations)",
                               Needs(devices=("cuda",), package="compressed_tensors",
                                     install="`pip install compressed-tensors` beside vLLM (vLLM imports it for FP8 "
                                             "weights)"), meanings=_gemm_meanings),
    "enforce_eager": EngineKnob("enforce_eager", ("true", "false"),
                                "the engine mode: false is vLLM's compiled default (--engine compiled)",
                                load_field="engine", setting=lambda value: "eager" if value == "true" else "compiled"),
}


def quantized(args: dict) -> dict[str, str]:
    """The args of `args` that quantize something (a knob with tap meanings, set to other than its default): knob ->
    its value."""
    return {key: str(args[key]) for key, knob in KNOBS.items()
            if knob.meanings is not None and key in args and args[key] != knob.default}


def check_knobs(args: dict, device: str) -> None:
    """Refuse, in one line and before anything loads, a knob setting the tool does not measure or that this device or
    installation cannot run."""
    for key, value in quantized(args).items():
        knob = KNOBS[key]
        if value not in knob.values:
            raise ProbeError(f"--engine-args {key}={value!r} is not a setting the tool measures; use one of: "
                             f"{', '.join(knob.values)}")
        knob.needs.check(f"--engine-args {key}={value}", "the engine", device,
                         "drop it here, or run on a GPU machine")


def tap_meanings(args: dict) -> dict[str, str]:
    """What the engine's taps are under these args, where that differs from the trainer's tensor of the same name:
    tap -> what it is. The taps read BF16 tensors at module boundaries (the quantized copies live inside the kernels),
    so they still pair with the trainer's; these say what differs in what produced them."""
    return {tap: meaning for key, value in quantized(args).items() for tap, meaning in KNOBS[key].meanings(value).items()}


# Engine args the tool sets itself, or that would make capture wrong: the reason and the fix, one line each.
OWNED_ENGINE_ARGS = {
    "model": "the checkpoint is the run's model; pass it as the model argument",
    "dtype": "--dtype sets it for both stacks",
    "seed": "--seed sets it for both stacks",
    "max_model_len": "it is set from the checkpoint's config for both stacks",
    "max_num_batched_tokens": "--batch-tokens sets it (one engine step holds one whole batch of prompts)",
    "enforce_eager": "--engine eager|compiled chooses it",
    "revision": "both stacks must load the same weights; point the model argument at that revision",
    "load_format": "both stacks must load the same weights from the checkpoint",
    "hf_overrides": "both stacks must build the same model; edit the checkpoint's config instead",
}
