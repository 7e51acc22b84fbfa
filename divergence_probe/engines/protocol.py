"""The Stack protocol: what the comparison needs from an inference engine or a training framework.

A stack loads a checkpoint, runs prompts (token ids, never text) and reports, per prompt, the logits and
logprobs of every prompt token after the first, while handing each requested tap to a sink as soon as it
is produced. The comparison pairs the two stacks' taps and reduces them; no stack ever sees the other.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # annotations only: importing the module (the CLI's --help) needs no torch
    import torch

from ..errors import StackError
from ..options import option
from ..taps import Tap, TapKey
from ..tokenized import Prompt

TapSink = Callable[[int, Tap, "torch.Tensor"], None]
"""sink(prompt_id, tap, tensor): one tap as [tokens, features], or a tuple of taps stacked as [taps, tokens, features]
(taps.Tap; `taps.each_tap` unstacks). The tensor stays as handed over until the stack's next call (score, sample,
score_batched), so a sink may keep it as it is until then; one that keeps it longer copies it. vLLM clones what it
overwrites within a forward, but a compiled engine hands over views of its tap buffers, which its next step writes
again; transformers writes no activation in place and hands over views."""


ScoresSink = Callable[["PromptScores"], None]


@dataclass(frozen=True, kw_only=True)
class StackSettings:
    """How both stacks are loaded. One object, so the two sides provably get the same dtype and device."""

    model_path: str
    dtype: torch.dtype
    device: str  # "cpu" or "cuda"
    seed: int = 0
    max_model_len: int = 2048
    train_attn: str = "sdpa"  # transformers attention implementation (training side)
    train_experts: str | None = None  # transformers experts implementation (training side); None: transformers' own
    batch_tokens: int = 8192  # most prompt tokens one vLLM step holds; bounds capture memory
    engine: str = "eager"  # vLLM: "eager" (enforce_eager, every module hook fires) or "compiled" (vLLM's defaults)
    engine_args: tuple[tuple[str, object], ...] = ()  # extra vllm.LLM keywords, frozen (`freeze_engine_args`)
    train_sdpa: str = "auto"  # SDPA kernel of the training forward: auto, math, flash, efficient, cudnn
    train_state: str = "isolated"  # torch numerics of the training forward: isolated (pre-vLLM) or inherited
    train_precision: str = "bf16"  # training side: bf16 (weights in `dtype`) or amp (FP32 weights, autocast to dtype)
    train_kernels: str = "torch"  # training side: the kernel set its forward runs (engines/hf/kernels/)
    train_tp: int = 1  # training side: ranks it is sharded over (engines/hf/tensor_parallel.py)
    engine_taps: frozenset[str] = frozenset()  # compiled vLLM: layer taps the engine gets tap points and buffers for
    # (engines/vllm/compiled_taps.py); empty: none, vLLM as deployed

    def engine_kwargs(self) -> dict[str, object]:
        """The engine args as the user gave them (JSON values), for vllm.LLM and the manifest."""
        return {key: _thaw(value) for key, value in self.engine_args}


class _JSONObject(tuple):
    """A JSON object frozen as sorted (key, value) pairs: hashable, and thawed back into a dict, not a list."""


def _freeze(value):
    if isinstance(value, dict):
        return _JSONObject(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value):
    if isinstance(value, _JSONObject):
        return {k: _thaw(v) for k, v in value}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def freeze_engine_args(args: dict[str, object]) -> tuple[tuple[str, object], ...]:
    """{"compilation_config": {"mode": 3}, ...} -> sorted, hashable pairs for StackSettings.engine_args (settings
    are compared and hashed: one engine per process is kept per settings)."""
    return tuple(sorted((str(k), _freeze(v)) for k, v in args.items()))


@dataclass
class PromptScores:
    """One prompt's scores from one stack, for scored positions 1..T-1 (the token each logit row predicts).

    logits: [T-1, V] in the stack's own output dtype (kept, not upcast, so the KL sees what the stack made).
    logprobs: [T-1] float32, the logprob of the actual next token as the stack itself reports it.
    """

    prompt_id: int
    logits: torch.Tensor
    logprobs: torch.Tensor


@dataclass
class StackInfo:
    """What ran, for the manifest: versions, device, and the implementation each region dispatched to."""

    name: str
    versions: dict[str, str] = field(default_factory=dict)
    implementations: dict[str, str] = field(default_factory=dict)
    settings: dict[str, object] = field(default_factory=dict)


CAPTURED = "captured"
PATCH_AFTER_LOAD, PATCH_AT_BUILD, PATCH_NEVER = "after load", "at build", "never"
PATCH_ONCE_LOADED = "a region patch once loaded"  # the feature a stack whose `patch` is not "after load" refuses
ENGINE_REGIONS = "regions aligned in the engine (--align or ablate, --side both or infer)"  # a feature, as --graft is
TRAINER_REGIONS = "regions aligned in the trainer (--align or ablate, --side both or train)"


@dataclass(frozen=True)
class Capabilities:
    """What a stack can do, declared by its class before anything loads (`Stack.declare`), so a run is refused in one
    line before an engine starts, and asked of a loaded stack (`Stack.capabilities`) in place of probing its members.

    taps: canonical tap -> "captured", or why it is not (the manifest records it).
    refused: feature (a flag such as "--graft", "--mode generate", "ablate", "rl", ENGINE_REGIONS, PATCH_ONCE_LOADED)
        -> the one line that refuses it, saying why ("--graft cannot run at tensor_parallel_size 2: ...").
    patch: when a region patch takes effect: "after load" (in place, on the loaded modules), "at build" (only in an
        engine built with it: a compiled graph), "never" (the modules live in other processes).
    max_sequences_per_step: the most sequences one batch may hold (an engine's scheduler limit); None: no limit, or
        not known before the engine is built.
    logits: whether the stack hands over logits (a stack of recorded rollouts has logprobs only).
    records_routes, replays_routes, grafts: the optional roles (RouteRecorder, RouteReplayer, Grafter) it plays.
    tap_meanings: tap -> what the stack's tensor of that name is, where that differs from the trainer's (a quantized
        engine's GEMM outputs, keys bound for an FP8 KV cache); known once the stack's settings are (a loaded stack's
        `capabilities`), and recorded in the manifest beside the taps.
    own_process: its model runs in a process of its own (an engine worker), so the memory and the time its calls take
        are that process's, read there (the Metered role); else this process's allocator, resident set and clock
        measure them.
    """

    taps: Mapping[str, str]
    refused: Mapping[str, str] = field(default_factory=dict)
    patch: str = PATCH_AFTER_LOAD
    max_sequences_per_step: int | None = None
    logits: bool = True
    records_routes: bool = False
    replays_routes: bool = False
    grafts: bool = False
    tap_meanings: Mapping[str, str] = field(default_factory=dict)
    own_process: bool = False

    def __post_init__(self) -> None:  # read-only, as the dataclass is frozen: a declaration is shared
        if self.patch not in (PATCH_AFTER_LOAD, PATCH_AT_BUILD, PATCH_NEVER):
            raise ValueError(f"patch {self.patch!r} is not one of {PATCH_AFTER_LOAD!r}, {PATCH_AT_BUILD!r}, "
                             f"{PATCH_NEVER!r}")
        if self.patch != PATCH_AFTER_LOAD and PATCH_ONCE_LOADED not in self.refused:
            raise ValueError(f"a stack patched {self.patch!r} says why it refuses {PATCH_ONCE_LOADED!r}")
        object.__setattr__(self, "taps", MappingProxyType(dict(self.taps)))
        object.__setattr__(self, "refused", MappingProxyType(dict(self.refused)))
        object.__setattr__(self, "tap_meanings", MappingProxyType(dict(self.tap_meanings)))

    def first_refused(self, features: Sequence[str]) -> str | None:
        """The one-line refusal of the first of `features` this stack refuses, or None."""
        return next((self.refused[feature] for feature in features if feature in self.refused), None)

    def check_patchable(self) -> None:
        """Refuse, in the declared line, a region patch of the loaded stack when one takes effect only at its build."""
        if self.patch != PATCH_AFTER_LOAD:
            raise StackError(self.refused[PATCH_ONCE_LOADED])

    def not_captured(self) -> dict[str, str]:
        """The taps this stack cannot capture, and why."""
        return {name: why for name, why in self.taps.items() if why != CAPTURED}


class Stack(Protocol):
    name: str

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 1) -> Capabilities:
        """What the stack can do before it loads, for an engine mode ("eager" or "compiled": what an engine stack
        makes of --engine; others ignore it) at `ranks` processes (the registry's `stack_class` chose the class)."""
        ...

    def capabilities(self) -> Capabilities:
        """The loaded stack's: its declaration, with what loading learned (the taps a compiled engine was built with,
        its scheduler's limit)."""
        ...

    def load(self, settings: StackSettings) -> None: ...

    def score(self, prompts: Sequence[Prompt], taps: frozenset[str], sink: TapSink,
              on_scored: "ScoresSink | None" = None) -> list[PromptScores]:
        """Run the prompts (as one batch where the stack batches) and return their scores in prompt order.

        With `on_scored`, each prompt's scores go to it as soon as they are final, in prompt order, while the
        capture is still installed, and the returned list is empty: the caller can finish a prompt (pair and reduce
        its taps, drop its logits) before the next one runs, and the stack installs its hooks once per call rather
        than once per prompt."""
        ...

    def score_batched(self, prompts: Sequence[Prompt], taps: frozenset[str] = frozenset(),
                      sink: TapSink | None = None) -> list[PromptScores]:
        """The same scores with the prompts batched as the stack batches them (the batch-invariance noise floor); a
        stack may capture some taps there (a router's logits, for the routing floor) or none."""
        ...

    def sample(self, prompts: Sequence[Prompt], spec: "SamplingSpec", taps: frozenset[str], sink: TapSink) -> list["SequenceScores"]:
        """Sample responses as a rollout does and score prompt+response; taps keyed by sequence id."""
        ...

    def batch_groups(self, prompts: Sequence[Prompt]) -> list[list[Prompt]]:
        """The batches `score_batched` makes of these prompts."""
        ...

    def begin_run(self) -> None:
        """A run starts: what info() reports of a run (an engine's captured-logits gap) starts over."""
        ...

    def info(self) -> StackInfo: ...

    def close(self) -> None: ...


# The optional roles: a run asks the stack's Capabilities whether it plays one, then calls it.
RouteSource = Callable[[int, int], "tuple[torch.Tensor, torch.Tensor | None]"]


@runtime_checkable
class RouteRecorder(Protocol):
    """An engine that records the experts its router chose for every token (Capabilities.records_routes)."""

    def check_routes_recordable(self) -> None: ...

    def routes_recorded(self, taps: frozenset[str] = frozenset({"expert_ids"})) -> AbstractContextManager: ...


@runtime_checkable
class RouteReplayer(Protocol):
    """A trainer that runs its experts with another stack's routes (Capabilities.replays_routes)."""

    def routes_replayed(self, routes: RouteSource) -> AbstractContextManager[None]: ...


@runtime_checkable
class Grafter(Protocol):
    """A trainer that runs its own ops on another stack's captured inputs (Capabilities.grafts): --graft/--depth."""

    def replay(self, taps: Mapping) -> dict: ...

    def forward_from(self, start: int, hidden: "torch.Tensor", embeds: "torch.Tensor") -> "torch.Tensor": ...

    def lm_head(self, final_norm: "torch.Tensor") -> "torch.Tensor": ...


@runtime_checkable
class Metered(Protocol):
    """A stack whose model runs in a process of its own (Capabilities.own_process): what the calls made inside the
    block take, read in that process and set when the block ends."""

    def peak_memory(self) -> AbstractContextManager:
        """Their peak memory (engines/peak.py PeakMemory, `peak`)."""
        ...

    def step_time(self) -> AbstractContextManager:
        """The time its model spent in them, timed where it runs (engines/elapsed.py Elapsed, `seconds`): without
        the hand-over of their results to this process."""
        ...


# The trainer: what rl and ablate drive beyond the comparison's calls.
TapEmit = Callable[["TapKey", "torch.Tensor"], None]
"""emit(key, tensor): one tap of the forward running now, as the trainer's capture hands it over ([tokens, features]
views for one sequence; a router's rows for a batch)."""


class Trainer(Stack, Protocol):
    """A training stack as rl's trainer and ablate's trainer factors drive it, in this process: the compute model
    they differentiate, push and align regions on, its training forward and backward under the trainer's own torch
    numerics, its capture, and the kernel set it runs. engines/hf/trainer.py's HFStack is one; a trainer sharded over
    processes is a Stack only (its model is not here)."""

    model: "torch.nn.Module"  # the compute model: rl's weights, the modules a region patch replaces
    settings: StackSettings
    kernels: str  # the kernel set the forward runs now (--train-kernels)

    def forward(self, ids: "torch.Tensor", mask: "torch.Tensor", positions: "torch.Tensor", *,
                routes: "RouteSource | None" = None) -> "torch.Tensor":
        """Logits [B, L, V] of one right-padded batch (mask 1 on its tokens, positions from 0 per row) under the
        numerics of the "train" kind, outside inference mode so a loss can be differentiated through them. `routes`
        (a trainer that declares replays_routes): every expert layer runs the experts `routes(0, layer)` names for the
        batch's flattened rows, as `routes_replayed` does; rows that are not k distinct experts are refused once the
        forward ran."""
        ...

    def numerics(self, kind: str) -> "AbstractContextManager[Callable[..., AbstractContextManager[None]]]":
        """The trainer's torch state for a block of this kind of work ("train", "score", ...); it yields the context
        for the block's model calls (`observed(autocast=False)` for a backward), which also records the SDPA kernel
        the first block of each kind chose."""
        ...

    def capture(self, taps: frozenset[str], emit: TapEmit) -> AbstractContextManager:
        """Hand each selected tap of every forward inside the block to `emit` (as `score` does, without the prompt
        ids: the caller knows what runs)."""
        ...

    def kernels_used(self, name: str) -> AbstractContextManager[None]:
        """The forwards of this block on the kernel set `name`; the set the trainer was loaded with again after."""
        ...

    def layers_aligned(self, layers: Sequence[int], regions: Sequence[str]) -> list:
        """The replacements (engines/hooks.py) that align `regions` in the decoder layers `layers` alone, every other
        layer as loaded, for the caller's HookSet: remedies' FP32-layer arms, asked only of regions the class
        declares it aligns."""
        ...


@dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """How the inference stack samples rollouts (generate mode)."""

    max_new_tokens: int = option(64, "generate mode: most tokens sampled per response.")
    samples_per_prompt: int = option(1, "generate mode: responses sampled per prompt.")
    temperature: float = option(1.0, "generate mode: sampling temperature (0 = greedy). Compared logprobs stay raw "
                                     "(untempered).")
    top_p: float = option(1.0, "generate mode: nucleus sampling.")
    seed: int = option(0, "the run's seed (--seed)", cli=False)

    def request_seed(self, prompt_id: int, sample: int) -> int:
        """One seed per (prompt, sample): reproducible, and independent of how requests are batched."""
        return self.seed * 1_000_003 + prompt_id * 1009 + sample


@dataclass
class SequenceScores:
    """One sampled sequence (prompt + response) as the inference stack produced and scored it.

    token_ids: prompt then response; positions 1..L-1 are scored. logits: [L-1, V] in the stack's dtype.
    logprobs: [L-1] float32 as the stack reports them (prompt part: prompt logprobs; response part: the raw
    logprob of each sampled token). seq_id keys this sequence's taps.
    """

    seq_id: int
    prompt_id: int
    sample_id: int
    token_ids: tuple[int, ...]
    n_prompt: int
    logits: torch.Tensor
    logprobs: torch.Tensor


# The pre-load policy: what the class a registry entry hands out (`engines.stack_class`) decides before anything
# loads, so that the specs, the load and the runs ask the class and never import an engine's modules or compare an
# engine's name.
ENGINE_MODES = ("eager", "compiled")  # --engine: an engine run eagerly (every module hook fires), or compiled


@dataclass(frozen=True)
class Knob:
    """One deployment knob as an ablation factor (`ablate --factor SIDE:KEY=VALUE`), declared by the stack that
    owns it (StackClass.knobs): the values the tool measures, the LoadSpec field a factor changes and how, and who
    checks a value on a device (an engine's arg check, a kernel set's device and package check)."""

    side: str  # "engine" (the inference stack) or "train" (the trainer)
    key: str
    values: tuple[str, ...]  # the settings a factor may name
    field: str  # the LoadSpec field a factor of this knob changes
    change: Callable[[str, object], object]  # (the factor's value, the LoadSpec) -> the field's new value
    check: Callable[[str, str], None]  # (the factor's value, the device) -> None, or a ProbeError
    summary: str
    owner: str = ""  # the registry name of the stack that declares it (filled by the registry)

    @property
    def name(self) -> str:
        return f"{self.side}:{self.key}"


@dataclass(frozen=True)
class LoadPlan:
    """What a stack needs decided before it loads (StackClass.plan), for the load and its memory plan."""

    taps: frozenset[str] = frozenset()  # tap points it is built with (a compiled engine's graph seams); empty: none
    ranks: int = 1  # processes its model lives in (tensor parallel)
    kv_bytes_per_token: int | None = None  # its KV cache per token; None: it keeps no cache the memory plan sizes
    kv_cache_bytes: int | None = None  # a KV cache fixed before planning (the user's, or the platform's); None: planned
    share: float | None = None  # the share of the device the user gave it, where it takes one
    engine_args: Mapping[str, object] = field(default_factory=dict)  # planned arguments, merged under the user's


class KernelSet(Protocol):
    """Which ops a trainer's forward runs (`--train-kernels`), as far as a check before loading asks."""

    name: str
    backward: bool  # whether its ops carry gradients: a training step (rl's, remedies' cost step) steps through them

    def check(self, device: str) -> None: ...

    def check_regions(self, regions: Sequence[str], side: str) -> None: ...

    def check_backward(self) -> None: ...


class StackClass(Protocol):
    """The class a registry entry hands out: its capabilities (`Stack.declare`) and its pre-load policy."""

    name: str
    title: str  # how a line for the user names it ("vLLM")
    workers: bool  # whether `for_settings(settings, regions)` builds it in a worker process of its own
    released: str  # what became of it once an alternate placement's engine passes are done (the manifest's words)
    modes: tuple[str, ...]  # the engine modes it runs (--engine); empty: none, it runs as it loads
    sdpa: bool  # its forward runs torch's SDPA, whose kernel --train-sdpa picks (the kernel noise floor switches it)
    libraries: tuple[str, ...]  # what it imports beyond torch and transformers (versions checked before loading)
    owned_args: Mapping[str, str]  # engine args the tool sets itself (or that would make capture wrong), and why
    patches: str  # "module:NAME" of its region patches (region -> patcher, engines/patching.py), imported when it is
    # first patched; "": it takes no region
    aligns: tuple[str, ...]  # the regions its patches align (the keys of `patches`), declared so that a run asking for
    # another is refused before anything loads, where importing the patches would import the engine
    sides: tuple[str, ...]  # the sides of a comparison it may sit on ("infer", "train"): asked of a stack an installed
    # package adds once it is chosen (engines.check_side); the registry lists its own stacks' sides

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 1) -> Capabilities: ...

    @classmethod
    def check_settings(cls, load, *, imports: bool = False) -> None:
        """Refuse in one line what it cannot load of these settings (a LoadSpec); `imports`: also ask its installed
        library (it may be imported; nothing starts)."""
        ...

    @classmethod
    def ranks(cls, engine_args: Mapping[str, object]) -> int:
        """The processes its model lives in under these engine args (an arg of another type counts as one: the
        settings check refuses it)."""
        ...

    @classmethod
    def knobs(cls) -> Mapping[str, Knob]:
        """Its deployment knobs, by Knob.name."""
        ...

    @classmethod
    def kernel_sets(cls) -> tuple[str, ...]:
        """The kernel sets its forward can run (--train-kernels); empty: it runs its own."""
        ...

    @classmethod
    def kernel_set(cls, name: str) -> KernelSet: ...

    @classmethod
    def refused_replay(cls, engine_args: Mapping[str, object], allowed: Sequence[str] = ()) -> list[str]:
        """Which of a run folder's recorded engine args a rerun does not pass again without asking (dotted for a
        nested key); `allowed`: those the user allowed."""
        ...

    @classmethod
    def check_model(cls, settings: StackSettings, config: dict) -> None:
        """Refuse in one line what it cannot load of this model (its config.json) under these settings."""
        ...

    @classmethod
    def plan(cls, settings: StackSettings, *, family=None, taps: str | None = None, routes: bool = False,
             size=None, total_bytes: int = 0, stacks_on_device: int = 1, budget: tuple[int, float] | None = None
             ) -> LoadPlan:
        """Its load plan for `settings`: the tap points for the `taps` the runs ask (`routes`: a run replays its
        routes), its ranks, and for the memory plan its KV bytes per token (`size`: models.ModelSize) and a cache
        fixed before planning (`total_bytes`: the device's, shared by `stacks_on_device` stacks' weights). With
        `budget` (the KV bytes the memory plan gave it, and its share of the device), the engine args that size it."""
        ...

    @classmethod
    def for_settings(cls, settings: StackSettings, regions: Sequence[str] | None = None) -> Stack:
        """A fresh, unloaded stack of the variant these settings need: in this process, or over several processes
        (tensor parallel); with `regions` (those it is built with), one built in a worker process of its own
        (`workers`), started with `start()` or `load(settings)`."""
        ...

    @classmethod
    def unsharded(cls, settings: StackSettings) -> StackSettings:
        """These settings on one rank: the parallelism noise floor's stack."""
        ...

    @classmethod
    def other_mode(cls, settings: StackSettings) -> StackSettings:
        """These settings in the other engine mode: the engine noise floor's stack (`--engine-noise`, where the
        stack does not refuse it)."""
        ...


class StackPolicy:
    """The pre-load policy of a stack that declares nothing more: no knobs, no kernel sets, no engine args, one
    process, no tap points, no worker. A stack class inherits it and overrides what it has."""

    title = ""
    workers = False
    released = "closed: the engine was dropped in this process before the trainer loaded"
    modes: tuple[str, ...] = ()
    sdpa = False
    libraries: tuple[str, ...] = ()
    owned_args: Mapping[str, str] = MappingProxyType({})
    patches = ""
    aligns: tuple[str, ...] = ()
    sides: tuple[str, ...] = ("infer",)  # an engine; a trainer (protocol.Trainer) sits on the training side too

    @classmethod
    def check_settings(cls, load, *, imports: bool = False) -> None:
        if load.engine not in (cls.modes or ENGINE_MODES[:1]) or load.engine_args:
            raise StackError(f"--engine and --engine-args configure vLLM, but --infer is {load.infer}; "
                             "drop them or use --infer vllm")

    @classmethod
    def ranks(cls, engine_args: Mapping[str, object]) -> int:
        return 1

    @classmethod
    def knobs(cls) -> Mapping[str, Knob]:
        return {}

    @classmethod
    def kernel_sets(cls) -> tuple[str, ...]:
        return ()

    @classmethod
    def kernel_set(cls, name: str) -> KernelSet:
        raise StackError(f"--train-kernels {name!r}: the {cls.name} stack runs its own kernels")

    @classmethod
    def refused_replay(cls, engine_args: Mapping[str, object], allowed: Sequence[str] = ()) -> list[str]:
        return [key for key in engine_args if key not in allowed]

    @classmethod
    def check_model(cls, settings: StackSettings, config: dict) -> None:
        pass

    @classmethod
    def plan(cls, settings: StackSettings, *, family=None, taps: str | None = None, routes: bool = False,
             size=None, total_bytes: int = 0, stacks_on_device: int = 1, budget: tuple[int, float] | None = None
             ) -> LoadPlan:
        return LoadPlan()

    @classmethod
    def for_settings(cls, settings: StackSettings, regions: Sequence[str] | None = None) -> Stack:
        if regions is not None:
            raise StackError(f"the {cls.name} stack is not built in a worker process; align its regions in place")
        return cls()

    @classmethod
    def unsharded(cls, settings: StackSettings) -> StackSettings:
        return settings

    @classmethod
    def other_mode(cls, settings: StackSettings) -> StackSettings:
        raise StackError(f"the {cls.name} stack has no other engine mode")
