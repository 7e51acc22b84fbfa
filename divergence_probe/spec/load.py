"""LoadSpec: what is loaded, and how; both stacks get the same model files, dtype, device and seed."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Mapping

from ..engines import check_side, installed_names, stack_class, stacks_on
from ..engines.protocol import ENGINE_MODES
from ..errors import ProbeError, one_line
from ..options import option
from ..versions import ALLOW_HELP
from .fields import _choice

DTYPES = ("bfloat16", "float16", "float32")
TRAIN_ATTN = ("sdpa", "eager", "flash_attention_2")
TRAIN_SDPA = ("auto", "math", "flash", "efficient", "cudnn")
TRAIN_STATES = ("isolated", "inherited")
TRAIN_PRECISIONS = ("bf16", "amp")
DEVICES = ("auto", "cpu", "cuda")
PLACEMENTS = ("auto", "together", "alternate")  # --placement (runs/memory.placed)
DEFAULT_INFER, DEFAULT_TRAIN = "vllm", "hf"  # the stacks a run loads unless told (rl's, always)
SHIPPED_KERNELS = "torch"  # --train-kernels' default: the trainer's own ops, as it ships
TRAIN_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")  # --train-device: a device of its own may carry an index


def _stacks_help(text: str):
    """--infer's or --train's help: `text`, then the stacks installed packages add, read when the command is built
    (engines.installed_names), so that --help lists what this environment has."""
    def stacks_help() -> str:
        installed = installed_names()
        return f"{text} Installed: {', '.join(installed)}." if installed else text
    return stacks_help


def parse_engine_args(text: str | Mapping | None) -> dict:
    """--engine-args: a JSON object of `vllm.LLM` keyword arguments (as given; the stack checks the keys)."""
    if text is None or text == "":
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    if not isinstance(text, str):
        raise ProbeError("--engine-args must be a JSON object (text) or a dict of vllm.LLM keyword arguments")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProbeError(f"--engine-args is not valid JSON ({e.msg} at column {e.colno}); "
                         "pass an object such as '{\"max_num_seqs\": 64}'") from e
    except (RecursionError, ValueError) as e:  # nested past Python's recursion limit; an int of 5000 digits
        raise ProbeError(f"--engine-args is not JSON the tool reads ({one_line(e, 80)}); pass a flat object such as "
                         "'{\"max_num_seqs\": 64}'") from e
    if not isinstance(value, dict):
        raise ProbeError("--engine-args must be a JSON object of vllm.LLM keyword arguments, "
                         "such as '{\"max_num_seqs\": 64}'")
    return value


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """What is loaded, and how. Both stacks get the same model files, dtype, device and seed."""

    model: str | None = option(None, "Checkpoint folder or hub id (e.g. Qwen/Qwen2.5-1.5B). Default: the built-in "
                                     "tiny trained Qwen3.", short="-m")
    infer: str = option(DEFAULT_INFER, _stacks_help("Inference side: vllm, or hf (a second transformers instance: the "
                                                    "zero baseline)."))
    train: str = option(DEFAULT_TRAIN, _stacks_help("Training side: hf (transformers)."))
    dtype: str = option("bfloat16", "bfloat16, float16 or float32; both stacks use it.")
    device: str = option("auto", "auto (cuda when present), cpu or cuda.")
    engine: str = option("eager", "vLLM engine mode: eager (no compile, no CUDA graphs; layer taps work) or compiled "
                                  "(vLLM's own defaults, as RL frameworks run it; every layer tap but the residual stream "
                                  "and q/k norms). See docs/reference/engines.md, 'Engine modes and the "
                                  "trainer's process state'.")
    engine_args: dict = option(default_factory=dict, help="JSON object of extra vllm.LLM keyword arguments, passed "
                               "as given and recorded in the manifest (e.g. '{\"max_num_seqs\": 64}').",
                               )
    train_attn: str = option("sdpa", "transformers attention on the training side: sdpa, eager or flash_attention_2.")
    train_sdpa: str = option("auto", "SDPA kernel of the training side: auto (torch picks, as in a trainer process), "
                                     "math, flash, efficient or cudnn.")
    train_state: str = option("isolated", "Torch numerics state of the training side: isolated (the global flags as "
                                          "before vLLM was imported: what a trainer process has) or inherited (what "
                                          "vLLM left in this process; for measuring the difference).")
    train_precision: str = option("bf16", "Precision of the training side: bf16 (weights and compute in --dtype, pure "
                                          "BF16 at the default) or amp (FP32 master weights, forward under "
                                          "torch.autocast to --dtype, as torch AMP and FSDP mixed precision run: norms, "
                                          "the residual stream and RoPE stay FP32; needs --dtype bfloat16 or float16 "
                                          "and --taps none or logits).")
    train_kernels: str = option(SHIPPED_KERNELS, "Kernel set of the training side's forward: torch (transformers' eager "
                                         "ops, as shipped), vllm (the engine's own RMSNorm, fused add+norm, "
                                         "SiLU-and-mul and rotary kernels: what stays different is GEMMs and attention; "
                                         "no backward) or liger (Liger-Kernel's RMSNorm, RoPE and SwiGLU, as verl, "
                                         "OpenRLHF and TRL enable it; CUDA only).")
    train_device: str | None = option(None, "Device of the training stack: cpu, cuda or cuda:N (its own GPU beside "
                                            "the engine's, e.g. cuda:1; or the CPU beside a GPU engine). Default: "
                                            "--device. Logprobs and taps are compared on the engine's device.")
    train_tp: int = option(1, "Shard the training stack over N processes with transformers' tensor-parallel plan "
                              "(Megatron-style column/row parallel on DTensor; gloo on the CPU, NCCL on GPUs from "
                              "--train-device on); its column-parallel taps are gathered. No trainer-side regions, "
                              "--graft, --depth or amp. With --batch-invariance, also the trainer unsharded (the "
                              "parallelism floor).")
    seed: int = option(0, "Seed for every random choice (recorded in the manifest).")
    batch_tokens: int = option(8192, "Most prompt tokens per inference batch; bounds the memory held while pairing "
                                     "taps.")
    placement: str = option("auto", "How the two stacks share the device: together (both loaded at once), alternate "
                                    "(the engine runs every prompt first and its outputs are kept on the host; it is "
                                    "shut down before the trainer loads on the same device and runs against them: "
                                    "for a model whose weights fit the device once) or auto (together when the memory "
                                    "plan says both fit, else alternate). Same numbers either way.")
    keep_engine_outputs: bool = option(False, "--placement alternate: keep the engine's outputs where they spilled to "
                                              "disk (OUT/engine_outputs/) instead of removing them at the end.")
    allow_untested_versions: bool = option(False, ALLOW_HELP)

    @property
    def engine_ranks(self) -> int:
        """The processes the inference stack runs on (vLLM's tensor_parallel_size): which of its classes is asked what
        it can do. Another type than int counts as one: the stack's settings check refuses it."""
        return stack_class(self.infer).ranks(self.engine_args)

    def __post_init__(self) -> None:
        for side, name in (("infer", self.infer), ("train", self.train)):
            _choice(name, stacks_on(side), f"--{side}")
            check_side(name, side, f"--{side}")
        _choice(self.dtype, DTYPES, "--dtype")
        _choice(self.device, DEVICES, "--device")
        _choice(self.engine, ENGINE_MODES, "--engine")
        _choice(self.train_attn, TRAIN_ATTN, "--train-attn")
        _choice(self.train_sdpa, TRAIN_SDPA, "--train-sdpa")
        _choice(self.train_state, TRAIN_STATES, "--train-state")
        _choice(self.train_precision, TRAIN_PRECISIONS, "--train-precision")
        trainer = stack_class(self.train)
        if self.train_kernels != SHIPPED_KERNELS:
            _choice(self.train_kernels, trainer.kernel_sets(), "--train-kernels")
        _choice(self.placement, PLACEMENTS, "--placement")
        if self.placement == "alternate" and (self.train_tp > 1 or self.train_device is not None):
            raise ProbeError("--placement alternate loads the trainer on the engine's device once the engine is gone; "
                             "drop --train-tp/--train-device, or use --placement together")
        if self.keep_engine_outputs and self.placement == "together":  # no engine pass spills: nothing to keep
            raise ProbeError("--keep-engine-outputs keeps what the engine's pass spilled to disk under --placement "
                             "alternate, and --placement together spills nothing; drop --keep-engine-outputs or use "
                             "--placement alternate or auto")
        if self.train_device is not None and not TRAIN_DEVICE.fullmatch(self.train_device):
            raise ProbeError(f"--train-device {self.train_device!r} is not a device; use cpu, cuda or cuda:N "
                             "(e.g. cuda:1), or drop it for --device's")
        if self.train_precision == "amp" and self.dtype == "float32":
            raise ProbeError("--train-precision amp autocasts an FP32 model to --dtype, which is float32 here; use "
                             "--dtype bfloat16 or float16, or --train-precision bf16")
        object.__setattr__(self, "engine_args", parse_engine_args(self.engine_args))
        if self.train_tp < 1:
            raise ProbeError(f"--train-tp must be at least 1, got {self.train_tp}")
        if self.train_tp > 1 and self.train_precision == "amp":
            raise ProbeError(f"--train-precision amp is not built for a sharded trainer (--train-tp {self.train_tp}); "
                             "use --train-precision bf16 or --train-tp 1")
        if self.train_tp > 1 and self.train_state == "inherited":  # its ranks are fresh processes without vLLM
            raise ProbeError(f"--train-state inherited reads what vLLM left in this process, but --train-tp "
                             f"{self.train_tp}'s ranks are fresh processes; use --train-state isolated or --train-tp 1")
        if self.train_tp > 1 and self.train_kernels != "torch":
            raise ProbeError(f"--train-kernels {self.train_kernels} patches the trainer's modules, which live in "
                             f"--train-tp {self.train_tp}'s worker processes; use --train-kernels torch or --train-tp 1")
        if self.train_kernels != "torch":  # before anything loads: a device it cannot run on, a package not installed
            from ..environment import resolve_train_device

            trainer.kernel_set(self.train_kernels).check(resolve_train_device(self.train_device, self.device))
        if self.batch_tokens < 1:
            raise ProbeError("--batch-tokens must be positive")
        if not 0 <= self.seed < 2**32:
            raise ProbeError(f"--seed {self.seed} is out of range; use a number from 0 to {2**32 - 1}")
        if self.train_sdpa != "auto" and self.train_attn != "sdpa":
            raise ProbeError(f"--train-sdpa {self.train_sdpa} needs --train-attn sdpa (got {self.train_attn}); "
                             "drop --train-sdpa or use --train-attn sdpa")
        stack_class(self.infer).check_settings(self)  # the engine's own check, before anything loads
