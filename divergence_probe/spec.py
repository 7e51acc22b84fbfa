"""RunSpec: one frozen tree that says everything a run does; the CLI's flags and the manifest come from it.

    spec = RunSpec(kind="compare", load=LoadSpec(model="ckpt/"), capture=CaptureSpec(taps="none"))
    run = divergence_probe.run(spec)          # or: divergence-probe rerun RUN_DIR

Each component owns its fields, defaults and checks (`__post_init__`), so a bad flag fails before anything
loads, and every default lives in exactly one place: here. Fields are declared with `options.option`, which
also carries the flag's help text; `cli.py` generates each command's options from these fields. The manifest
stores `spec.to_dict()`, and `RunSpec.from_dict` turns it back into the same spec, which is what `rerun` runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import Field, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from .errors import ProbeError, StackError, one_line
from .options import check_finite, finite_number, option
from .prompts import check_kind
from .rollouts.adapters import EXPORT_FORMATS
from .regions import ALL_REGIONS, REGIONS, check_regions_exist, parse_regions
from .numerics.shapley import METRICS
from .versions import ALLOW_HELP
from .rundir import KINDS
from .engines import INFER_STACKS, TRAIN_STACKS, capabilities_of
from .engines.protocol import ENGINE_REGIONS, TRAINER_REGIONS, SamplingSpec
from .taps import ALL_TAPS, parse_tap_selection

DTYPES = ("bfloat16", "float16", "float32")
TRAIN_ATTN = ("sdpa", "eager", "flash_attention_2")
TRAIN_SDPA = ("auto", "math", "flash", "efficient", "cudnn")
TRAIN_STATES = ("isolated", "inherited")
TRAIN_PRECISIONS = ("bf16", "amp")
DEVICES = ("auto", "cpu", "cuda")
TRAIN_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")  # --train-device: a device of its own may carry an index
SIDES = ("both", "train", "infer")
ROUTING_REPLAYS = ("ids", "ids+weights")
MODES = ("prefill", "generate")


def _choice(value, allowed, flag: str) -> None:
    if value not in allowed:
        raise ProbeError(f"{flag} {value!r} is not valid; choose one of: {', '.join(map(str, allowed))}")


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
    infer: str = option("vllm", "Inference side: vllm, or hf (a second transformers instance: the zero baseline).")
    train: str = option("hf", "Training side: hf (transformers).")
    dtype: str = option("bfloat16", "bfloat16, float16 or float32; both stacks use it.")
    device: str = option("auto", "auto (cuda when present), cpu or cuda.")
    engine: str = option("eager", "vLLM engine mode: eager (no compile, no CUDA graphs; layer taps work) or compiled "
                                  "(vLLM's own defaults, as RL frameworks run it; every layer tap but the residual stream "
                                  "and q/k norms). See docs/reference.md, 'Engine modes and the "
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
    allow_untested_versions: bool = option(False, ALLOW_HELP)

    def __post_init__(self) -> None:
        _choice(self.infer, INFER_STACKS, "--infer")
        _choice(self.train, TRAIN_STACKS, "--train")
        _choice(self.dtype, DTYPES, "--dtype")
        _choice(self.device, DEVICES, "--device")
        from .engines.vllm.stack import ENGINES  # here, not at import: the CLI's --help reads this module without torch

        _choice(self.engine, ENGINES, "--engine")
        _choice(self.train_attn, TRAIN_ATTN, "--train-attn")
        _choice(self.train_sdpa, TRAIN_SDPA, "--train-sdpa")
        _choice(self.train_state, TRAIN_STATES, "--train-state")
        _choice(self.train_precision, TRAIN_PRECISIONS, "--train-precision")
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
        if self.batch_tokens < 1:
            raise ProbeError("--batch-tokens must be positive")
        if not 0 <= self.seed < 2**32:
            raise ProbeError(f"--seed {self.seed} is out of range; use a number from 0 to {2**32 - 1}")
        if self.train_sdpa != "auto" and self.train_attn != "sdpa":
            raise ProbeError(f"--train-sdpa {self.train_sdpa} needs --train-attn sdpa (got {self.train_attn}); "
                             "drop --train-sdpa or use --train-attn sdpa")
        if self.infer != "vllm" and (self.engine != "eager" or self.engine_args):
            raise ProbeError(f"--engine and --engine-args configure vLLM, but --infer is {self.infer}; "
                             "drop them or use --infer vllm")


@dataclass(frozen=True, kw_only=True)
class PromptSpec:
    """Which prompts are scored."""

    prompts: str | None = option(None, ".txt (blank-line or --- separated), .jsonl (prompt or chat messages), or a "
                                       "folder of them. Default: the packaged sample prompts (divergence_probe/data/sample_prompts/).", short="-p")
    num_prompts: int | None = option(None, "Use only the first N prompts.", short="-n")
    max_prompt_tokens: int | None = option(None, "Truncate prompts to N tokens (otherwise a prompt longer than the "
                                                 "context is an error).")

    def __post_init__(self) -> None:
        if self.prompts is not None:
            object.__setattr__(self, "prompts", str(self.prompts))
            check_kind(Path(self.prompts))
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ProbeError(f"--num-prompts must be at least 1, got {self.num_prompts}.")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 2:
            raise ProbeError(f"--max-prompt-tokens must be at least 2 (every token after the first is scored), "
                             f"got {self.max_prompt_tokens}.")


@dataclass(frozen=True, kw_only=True)
class CaptureSpec:
    """What is captured and how divergence is judged."""

    taps: str = option("all", "all, none, or a comma list of tap names (" + ", ".join(ALL_TAPS) + ").")
    threshold: float = option(1e-3, "rel_l2 above which a tap counts as diverged (first_over_threshold).")
    batch_invariance: bool = option(False, "Also measure the noise floor: each stack alone vs batched on the same "
                                           "sequences (batch_invariance.csv), and the training stack under another "
                                           "SDPA kernel (kernel_noise.csv); the summary reads the mismatch against "
                                           "the largest floor.")
    graft: bool = option(False, "Also measure each op's local error: the training stack's op on the inference "
                                "stack's captured input of that op, against the inference output (local.csv, "
                                "local_families.csv). Captures every tap; needs --engine eager.")
    depth: bool = option(False, "Also continue the training forward from the inference residual stream entering each "
                                "layer and score it against the inference logits (depth.csv; implies --graft; costs "
                                "about L/2 extra forwards per prompt).")
    engine_noise: bool = option(False, "Also score the sequences on a vLLM engine in the other engine mode (eager if "
                                       "--engine compiled, else compiled; same regions), built in a worker process, "
                                       "and report its mean |Δlogp| to this run's engine (engine_noise.csv): the "
                                       "engine's own eager-vs-compiled gap. A compiled engine built with tap points "
                                       "is also checked against one built without them (tap_points_mean_abs_dlogp: 0 "
                                       "when the taps left its numerics alone). At tensor_parallel_size N > 1: the "
                                       "engine at 1 instead (the parallelism floor). Costs one or two engine builds.")

    def __post_init__(self) -> None:
        check_finite(self)
        if not self.threshold >= 0:
            raise ProbeError("--threshold must be a non-negative number")
        parse_tap_selection(self.taps)

    @property
    def tap_names(self) -> frozenset[str]:
        return parse_tap_selection(self.taps)


@dataclass(frozen=True, kw_only=True)
class GenerateSpec(SamplingSpec):
    """prefill scores the prompts; generate samples responses through the engine's decode path, as RL does."""

    mode: str = option("prefill", "prefill: score the prompts (vLLM's prompt logprobs); generate: sample responses "
                                  "through vLLM's decode path and compare what RL sees.")
    clip_eps: float = option(0.2, "generate mode: PPO clip band [1-eps, 1+eps] for the ratio metrics.")
    tis_cap: float = option(2.0, "generate mode: TIS truncation cap C (token MIS band [1/C, C]).")
    rollouts_format: str = option("generic", "generate mode: the layout of rollouts.jsonl, the samples with the "
                                             "engine's logprobs that `score` reads back: " + ", ".join(EXPORT_FORMATS)
                                             + " (each framework's own field names).")

    def __post_init__(self) -> None:
        check_finite(self)
        _choice(self.mode, MODES, "--mode")
        _choice(self.rollouts_format, EXPORT_FORMATS, "--rollouts-format")
        checks = [
            (self.max_new_tokens >= 1, "--max-new-tokens must be at least 1"),
            (self.samples_per_prompt >= 1, "--samples-per-prompt must be at least 1"),
            (self.temperature >= 0, "--temperature must be >= 0 (0 = greedy)"),
            (0 < self.top_p <= 1, "--top-p must be in (0, 1]"),
            (0 < self.clip_eps < 1, "--clip-eps must be in (0, 1)"),
            (self.tis_cap > 1, "--tis-cap must be > 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ProbeError(message)

    @property
    def generates(self) -> bool:
        return self.mode == "generate"


def _regions(value) -> tuple[str, ...]:
    return parse_regions(value if value is not None else ())


@dataclass(frozen=True, kw_only=True)
class AlignSpec:
    """Regions computed in FP32 until one rounding at their output, and on which stacks."""

    regions: tuple[str, ...] = option((), "Regions to align (FP32 until the output, one rounding): comma list of "
                                          + ", ".join(REGIONS) + ".", flag="--align")
    side: str = option("both", "Where regions are aligned: both, train (transformers only; the engine as shipped) "
                               "or infer.")
    routing_replay: str = option("ids", "With the routing region (MoE): what the trainer takes from the engine. ids: "
                                        "the engine's experts for every token and layer, the trainer's own gate "
                                        "weights for them (R3, as verl and Megatron replay routes); ids+weights: the "
                                        "engine's gate weights too.")

    def __post_init__(self) -> None:
        check_finite(self)
        object.__setattr__(self, "regions", _regions(self.regions))
        _choice(self.side, SIDES, "--side")
        _choice(self.routing_replay, ROUTING_REPLAYS, "--routing-replay")


@dataclass(frozen=True, kw_only=True)
class AblateSpec:
    """Every subset of `regions` aligned (on the AlignSpec's side), and the attribution of the mismatch."""

    regions: tuple[str, ...] = option(ALL_REGIONS, "Regions to ablate; all 2^k subsets run.")
    metric: str = option("mean_kl", "What attribution explains: " + ", ".join(METRICS) + ".")
    bootstrap: int = option(1000, "Bootstrap resamples of prompts for confidence intervals (0 = none).")
    ci_level: float = option(0.95, "Confidence level of the bootstrap intervals.")
    build_ahead: int | None = option(None, "With a compiled engine aligned per combination: how many combinations' "
                                           "engines build in worker processes while the current one runs. Default: 1 "
                                           "on the CPU, 0 on a GPU (each engine reserves GPU memory; on a GPU, N > 0 "
                                           "needs --engine-args with a small gpu_memory_utilization and "
                                           "kv_cache_memory_bytes, since engines starting together would read each "
                                           "other's allocations as their own in vLLM's memory profiling).")

    def __post_init__(self) -> None:
        check_finite(self)
        object.__setattr__(self, "regions", _regions(self.regions))
        if self.build_ahead is not None and self.build_ahead < 0:
            raise ProbeError("--build-ahead must be >= 0")
        if not self.regions:
            raise ProbeError("--regions is empty; name at least one region")
        builds = 2 ** len(self.regions) - 1  # every combination but the shipped one builds an engine
        if self.build_ahead is not None and self.build_ahead > builds:  # more would only start nothing, slowly
            raise ProbeError(f"--build-ahead {self.build_ahead} is more than the {builds} engine builds of "
                             f"{len(self.regions)} regions; use 0 to {builds}")
        _choice(self.metric, tuple(METRICS), "--metric")
        if self.bootstrap < 0:
            raise ProbeError("--bootstrap must be >= 0")
        if not 0 < self.ci_level < 1:
            raise ProbeError("--ci-level must be in (0, 1), e.g. 0.95")


COMPONENTS = {"load": LoadSpec, "prompts": PromptSpec, "capture": CaptureSpec, "generate": GenerateSpec,
              "align": AlignSpec, "ablate": AblateSpec}


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run: a compare (one alignment setting) or an ablate (every subset of regions)."""

    kind: str = "compare"
    load: LoadSpec = option(default_factory=LoadSpec)
    prompts: PromptSpec = option(default_factory=PromptSpec)
    capture: CaptureSpec = option(default_factory=CaptureSpec)
    generate: GenerateSpec = option(default_factory=GenerateSpec)
    align: AlignSpec = option(default_factory=AlignSpec)
    ablate: AblateSpec | None = None
    """None for a compare."""
    report: bool = option(False, "After the run is written, render OUT/report (report.md and figures; see the "
                                 "report command).")

    def __post_init__(self) -> None:
        _choice(self.kind, KINDS, "kind")
        if self.kind == "ablate" and self.ablate is None:
            object.__setattr__(self, "ablate", AblateSpec())
        if self.kind == "compare" and self.ablate is not None:
            raise ProbeError("a compare run has no ablation; use kind 'ablate'")
        infer = capabilities_of(self.load.infer, engine=self.load.engine)  # here: the CLI's --help imports no torch
        not_captured = infer.not_captured()
        refused = sorted(self.capture.tap_names & set(not_captured)) if self.capture.taps.strip() != "all" else []
        if refused:  # `all` captures what the stack can and lists the rest in the manifest
            why = not_captured[refused[0]].removeprefix("not captured")
            raise ProbeError(f"taps {', '.join(refused)} cannot be captured{why}; or drop them from --taps")
        if not self.generate.generates:
            changed = [flag_of(f) for f in fields(GenerateSpec) if f.metadata.get("cli", True) and f.name != "mode"
                       and getattr(self.generate, f.name) != f.default]
            if changed:
                these = "they only apply" if len(changed) > 1 else "it only applies"
                raise ProbeError(f"{', '.join(changed)}: {these} with --mode generate; add --mode generate or drop "
                                 + ("them" if len(changed) > 1 else "it"))
        if self.generate.seed != self.load.seed:  # each request's seed derives from the run's one seed
            object.__setattr__(self, "generate", replace(self.generate, seed=self.load.seed))
        layer_taps = self.capture.tap_names - {"logits"}
        if self.load.train_precision == "amp" and (layer_taps or self.capture.graft or self.capture.depth):
            raise ProbeError("--train-precision amp keeps the trainer's residual stream, norms and RoPE in FP32, so its "
                             "layer taps cannot be paired with the engine's; add --taps none (or --taps logits) and "
                             "drop --graft/--depth")
        if (self.capture.graft or self.capture.depth) and self.load.train_device is not None and not _same_device(
                self.load.train_device, self.load.device):
            raise ProbeError(f"--graft/--depth run the trainer's ops on the engine's own tensors, which are on "
                             f"--device {self.load.device}, not --train-device {self.load.train_device}; drop "
                             "--train-device or --graft/--depth")
        self._check_trainer()
        refusal = infer.first_refused(self._graft_features())
        if refusal:  # a compiled engine's
            raise ProbeError(refusal)
        if self.capture.engine_noise and self.load.infer != "vllm":
            raise ProbeError(f"--engine-noise measures vLLM's eager-vs-compiled gap, but --infer is {self.load.infer}; "
                             "drop --engine-noise or use --infer vllm")
        if self.kind == "ablate" and self.align.regions:
            raise ProbeError("ablate aligns every subset of --regions itself; drop --align")
        regions = self.ablate.regions if self.kind == "ablate" else self.align.regions
        if "lm_head" in regions and self.align.side != "both" and (
                "logits" in self.capture.tap_names or self.capture.graft or self.capture.depth):
            raise ProbeError(f"lm_head on --side {self.align.side} alone makes one stack's logits FP32 and the other's "
                             f"{self.load.dtype}, so the logits tap cannot be paired; drop logits from --taps (e.g. "
                             "--taps none) and --graft/--depth, or use --side both")
        if "residual" in regions and self.align.side != "both" and (
                {"resid_mid", "resid_out"} & self.capture.tap_names or self.capture.graft):
            raise ProbeError(f"residual on --side {self.align.side} alone makes one stack's residual stream FP32 and "
                             f"the other's {self.load.dtype}, so the resid_mid/resid_out taps cannot be paired; drop "
                             "them from --taps (e.g. --taps none) and --graft, or use --side both")
        if "routing" in regions and self.align.side == "infer":
            raise ProbeError("routing is replayed from the engine into the trainer, so it has no --side infer; use "
                             "--side train or both, or leave routing out")
        if "routing" in regions and self.capture.depth:
            raise ProbeError("--depth continues the trainer's forward with its own router, while routing replay runs "
                             "the trainer on the engine's experts, so the depth curve would not end at the run's own "
                             "gap; drop --depth or leave routing out")
        if self.align.routing_replay != "ids" and "routing" not in regions:
            raise ProbeError("--routing-replay applies to the routing region only; add routing to "
                             + ("--regions" if self.kind == "ablate" else "--align") + " or drop --routing-replay")
        if self.kind == "ablate" and self.ablate.build_ahead and "kv_cache_memory_bytes" not in self.load.engine_args \
                and _resolved_device(self.load.device) != "cpu":
            raise ProbeError("--build-ahead on a GPU starts engines together, and vLLM's memory profiling would count "
                             "the other engines' allocations as its own; add --engine-args '{\"gpu_memory_utilization\": "
                             "0.1, \"kv_cache_memory_bytes\": 2000000000}' (sized for your model), or drop --build-ahead")

    def _graft_features(self) -> list[str]:
        return [feature for feature, on in (("--graft", self.capture.graft), ("--depth", self.capture.depth)) if on]

    def _check_trainer(self) -> None:
        """What the trainer refuses (its Capabilities: one sharded over processes, engines/hf/tensor_parallel.py, runs
        no single op and takes no patch here), in one line."""
        regions = self.ablate.regions if self.kind == "ablate" else self.align.regions
        trainer_regions = [TRAINER_REGIONS] if regions and self.align.side != "infer" else []
        refusal = capabilities_of(self.load.train, ranks=self.load.train_tp).first_refused(
            [*self._graft_features(), *trainer_regions])
        if refusal:
            raise ProbeError(refusal)

    def to_dict(self) -> dict:
        """The spec as plain JSON data (the manifest's `spec`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunSpec":
        """The spec a manifest recorded, checked as the CLI checks its flags, before anything loads: a manifest is
        data anyone may have edited. Every field must be there (a default filled in would rerun another run than
        the one recorded; a field added since, LATER_FIELDS, takes the value that re-makes what older runs did), none
        may be unknown, each must have the type its flag parses to (no fractional count,
        no text for a bool), and then each component's own checks run. One ProbeError naming the field."""
        try:
            top = {f.name: f for f in fields(cls)}
            values = _fields_of(data, top, "spec")
            hints = _hints(cls)
            parts = {}
            for name, value in values.items():
                where = f"spec.{name}"
                if name in COMPONENTS:
                    parts[name] = None if value is None and name == "ablate" else _build(COMPONENTS[name], value, where)
                else:
                    parts[name] = _typed(value, hints[name], where, "--report" if name == "report" else name)
            try:
                return cls(**parts)
            except ProbeError as e:
                raise _SpecError(f"spec: {e}") from e
        except _SpecError as e:
            raise ProbeError(f"the recorded run spec does not fit this version of divergence-probe ({e}); fix the "
                             "manifest or re-run the command from its `command` instead") from None


def _resolved_device(device: str) -> str:
    from .environment import resolve_device

    return resolve_device(device)


def _same_device(train_device: str, device: str) -> bool:
    from .environment import resolve_train_device, same_device

    return same_device(resolve_train_device(train_device, device), _resolved_device(device))


class _SpecError(Exception):
    """A field of a recorded spec that does not fit (from_dict turns it into one ProbeError)."""


_KIND_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text", dict: "a JSON object"}
_INT_LIMIT = 2**63  # what torch, vLLM and numpy take as a count or a seed; larger is no value the tool wrote


def _hints(cls) -> dict:
    import typing

    return typing.get_type_hints(cls)


# Fields a recorded spec gained after runs were already recorded without them, by (component, field), and the value
# that re-makes what those runs did (the behaviour before the field existed): a folder written before the field is
# still re-runnable. Any other missing field is an error, as an unknown one is.
LATER_FIELDS: dict[tuple[str, str], object] = {
    ("capture", "graft"): False, ("capture", "depth"): False, ("capture", "engine_noise"): False,
    ("align", "routing_replay"): "ids", ("ablate", "build_ahead"): None, ("load", "train_precision"): "bf16",
    ("load", "train_device"): None, ("load", "train_tp"): 1,
    ("load", "allow_untested_versions"): False, ("generate", "rollouts_format"): "generic"}


def _fields_of(data, known: dict, where: str) -> dict:
    if not isinstance(data, Mapping):
        raise _SpecError(f"{where} is {type(data).__name__}, not a JSON object")
    unknown = sorted(map(str, set(data) - set(known)))
    if unknown:
        raise _SpecError(f"unknown field(s) {', '.join(f'{where}.{n}' for n in unknown)}")
    component = where.rpartition(".")[2].removesuffix("_spec")  # "spec.load", score's "score.load_spec" -> "load"
    later = {n: LATER_FIELDS[(component, n)] for n in known if n not in data and (component, n) in LATER_FIELDS}
    missing = [n for n in known if n not in data and n not in later]
    if missing:
        raise _SpecError(f"{where} lacks the field(s) {', '.join(missing)}")
    return {**later, **data}


def _typed(value, hint, where: str, flag: str):
    """value as the CLI would have parsed it for a field of type `hint`, or _SpecError naming the field."""
    import typing

    args = typing.get_args(hint)
    if type(None) in args:  # X | None
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is tuple:  # a comma list on the command line, a JSON list in the manifest
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        ok, kind = False, "a list of names"
    elif hint is bool:
        ok, kind = isinstance(value, bool), _KIND_WORDS[bool]
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and -_INT_LIMIT < value < _INT_LIMIT
        kind = "a whole number (below 2^63)"
    elif hint is float:
        ok = finite_number(value)
        value, kind = float(value) if ok else value, "a finite number"
    elif hint in (str, dict):
        ok, kind = isinstance(value, hint), _KIND_WORDS[hint]
    else:  # a field type this function does not know: a bug here, not in the manifest
        raise TypeError(f"{where}: no manifest check for fields of type {hint}")
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise _SpecError(f"{where} ({flag}) is {shown}, not {kind}")
    return value


def _build(cls, values, where: str):
    """One component of a recorded spec, every field checked (see RunSpec.from_dict)."""
    known = {f.name: f for f in fields(cls)}
    values = _fields_of(values, known, where)
    hints = _hints(cls)
    typed = {name: _typed(value, hints[name], f"{where}.{name}", flag_of(known[name])) for name, value in values.items()}
    try:
        return cls(**typed)
    except ProbeError as e:
        raise _SpecError(f"{where}: {e}") from e


def recorded(cls, values, where: str):
    """A spec dataclass other than RunSpec (score's, a LoadSpec) as a manifest recorded it, checked as from_dict
    checks a RunSpec: every field there, none unknown, each of its flag's type, then the class's own checks. One
    ProbeError naming the field."""
    try:
        return _build(cls, values, where)
    except _SpecError as e:
        raise ProbeError(f"the recorded {where} does not fit this version of divergence-probe ({e}); fix the "
                         "manifest or re-run the command from its `command` instead") from None


def recorded_value(cls, name: str, value, where: str):
    """One field of the spec class `cls` as a manifest recorded it, for a reader that uses a few (report): of its
    flag's type, and passing the class's own checks with its other fields at their defaults. The ProbeError names the
    field, as `recorded`'s does."""
    f = next(f for f in fields(cls) if f.name == name)
    try:
        typed = _typed(value, _hints(cls)[name], where, flag_of(f))
        try:
            cls(**{name: typed})
        except ProbeError as e:
            raise _SpecError(f"{where}: {e}") from e
    except _SpecError as e:
        raise ProbeError(f"the recorded {where} does not fit this version of divergence-probe ({e}); fix the "
                         "manifest or re-run the command from its `command` instead") from None
    return typed


def flat_fields(kind: str) -> list[tuple[str | None, Field, str]]:
    """(component, field, flat name) of every option a command of `kind` takes, in declaration order.

    The flat name is the flag without dashes (`--max-new-tokens` -> max_new_tokens); it is what the CLI's
    parameters and the keyword arguments of `Probe.compare`/`Probe.ablate` are called. Unique per kind."""
    out = []
    for component, cls in COMPONENTS.items():
        if component == "ablate" and kind != "ablate":
            continue
        for f in fields(cls):
            if not f.metadata.get("cli", True) or (kind == "ablate" and component == "align" and f.name == "regions"):
                continue
            out.append((component, f, flag_of(f)[2:].replace("-", "_")))
    report = next(f for f in fields(RunSpec) if f.name == "report")
    out.append((None, report, "report"))
    return out


def flag_of(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def spec_from_flat(kind: str, *, load: LoadSpec | None = None, **flat) -> RunSpec:
    """A RunSpec from flat option names (the CLI's, and the Python API's keyword arguments). `load`: the load settings
    of an already loaded probe, in place of flat load options (checks that involve the load see the real ones)."""
    table = {name: (component, f) for component, f, name in flat_fields(kind)}
    unknown = sorted(set(flat) - set(table))
    if unknown:
        raise ProbeError(f"unknown option(s) for {kind}: {', '.join(unknown)}; known: {', '.join(table)}")
    parts: dict[str, dict] = {}
    top = {}
    for name, value in flat.items():
        component, f = table[name]
        if component is None:
            top[f.name] = value
        else:
            parts.setdefault(component, {})[f.name] = value
    built = {component: COMPONENTS[component](**values) for component, values in parts.items()}
    if load is not None:
        if "load" in built:
            raise ProbeError("load options and a loaded probe's load settings at once; pass one or the other")
        built["load"] = load
    if kind == "ablate":
        built.setdefault("ablate", AblateSpec())
    return RunSpec(kind=kind, **built, **top)


def check_family(run: "RunSpec | None", load: LoadSpec, family) -> None:
    """Refuse, before any stack loads, what the model's family cannot do yet (models/: `Family.unsupported`), regions
    its layers do not have, and what the inference stack refuses as loaded (its Capabilities: e.g. what cannot run on
    an engine at tensor_parallel_size > 1, engines/vllm/tensor_parallel.py)."""
    check_regions_exist(family, () if run is None else run.ablate.regions if run.kind == "ablate" else run.align.regions)
    if load.train_tp > 1 and family.top_k_field is not None:  # its experts' plan shards the routed tokens: not built
        raise ProbeError(f"--train-tp {load.train_tp} is built for dense models; {family.model_type} is a mixture of "
                         "experts; use --train-tp 1")
    wanted = []
    if load.engine == "compiled" and load.infer == "vllm":
        wanted.append("--engine compiled")
    if run is not None:
        wanted += [f for f, on in (("--graft", run.capture.graft), ("--depth", run.capture.depth),
                                   ("--align", bool(run.align.regions)), ("ablate", run.kind == "ablate")) if on]
    ranks = load.engine_args.get("tensor_parallel_size") if load.infer == "vllm" else 1
    ranks = ranks if isinstance(ranks, int) else 1  # another type: check_engine_args refuses it
    if ranks > 1:
        wanted.append("tensor_parallel_size > 1")
    for feature in wanted:
        if feature in family.unsupported:
            raise ProbeError(f"{feature} {family.unsupported[feature]}; drop it for this model")
    engine_regions = run is not None and run.align.side != "train" and bool(
        run.ablate.regions if run.kind == "ablate" else run.align.regions)  # --align/ablate on the trainer alone
    refusal = capabilities_of(load.infer, engine=load.engine, ranks=ranks).first_refused(
        [*wanted, *([ENGINE_REGIONS] if engine_regions else []),
         *(["--mode generate"] if run is not None and run.generate.generates else [])])
    if refusal:
        raise StackError(refusal)
