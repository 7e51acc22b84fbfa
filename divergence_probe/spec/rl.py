"""RLSpec: every option of the rl command, declared once (the CLI's flags and the manifest come from it).

rl loads its model, engine and trainer as compare does, so those options are a LoadSpec's fields and its prompt files
a PromptSpec's, composed as RunSpec composes them; RLSpec declares only what is rl's own. RL_FLAGS lists the options
in the order --help shows them, each with the part that declares it.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields

from ..errors import ProbeError
from ..options import option
from ..regions import ALL_REGIONS, get_region, parse_regions
from ..rl_choices import CORRECTIONS
from .align import unaligned
from .fields import check_finite
from .generate import MAX_GROUP_SIZE, MAX_NEW_TOKENS
from .load import DEFAULT_INFER, DEFAULT_TRAIN, SHIPPED_KERNELS, LoadSpec, parse_engine_args
from .prompts import PromptSpec

SIDES = ("both", "train")
NO_SIGNAL_STEPS = ("step", "skip")
# Upper bounds of the counts: each is a loop or a batch the run makes whole, so a mistyped value would run for hours
# or fill memory before anything failed. Well above what GRPO recipes use (groups of 4 to 64 responses, a few
# hundred prompts per step, responses of a few thousand tokens), and far below what would never finish.
MAX_STEPS = 100_000
MAX_SEEDS = 100
MAX_PROMPTS_PER_STEP = 1024
MAX_RESPONSES_PER_STEP = 8192  # the trainer scores every response of a step in one forward batch
# vllm.LLM keywords rl sets itself. The reasons compare gives for them (the engine's StackClass.owned_args) name flags rl
# does not have, so rl refuses them here, with its own reasons, before vLLM is imported; any other key compare owns is covered
# by the generic reason.
ENGINE_ARGS_OWNED = {
    "dtype": "rl runs both sides in bfloat16",
    "seed": "--seed sets it",
    "enforce_eager": "--engine eager|compiled chooses it",
    "enable_prefix_caching": "rl runs with prefix caching on, as production rollouts do (the stale-cache probe "
                             "checks it after every push)",
}
STACKS_NAMED = {"infer": "rl's rollout engine", "train": "rl's trainer"}  # rl has no --infer/--train flag to name them


def setting_name(regions: tuple[str, ...], knobs: tuple[str, ...] = ()) -> str:
    return ",".join((*regions, *knobs)) or "none"


@dataclass(frozen=True)
class RLSetting:
    """One arm of an rl experiment: the regions it aligns (routing: R3) and the deployment knobs it turns, each a
    SIDE:KEY=VALUE label of spec/knobs.py (the engine's FP8 KV cache, the trainer's kernel set or precision) or
    train:correction=tis|mis (the off-policy correction of the update)."""

    regions: tuple[str, ...] = ()
    knobs: tuple[str, ...] = ()  # labels, sorted by knob name

    @property
    def name(self) -> str:
        return setting_name(self.regions, self.knobs)

    def value(self, knob: str) -> str | None:
        """The value this setting gives `knob` ('train:kernels'), or None when it leaves it as the run has it."""
        return next((label.partition("=")[2] for label in self.knobs if label.partition("=")[0] == knob), None)

    @property
    def engine_knobs(self) -> tuple[str, ...]:
        return tuple(label for label in self.knobs if label.startswith("engine:"))


CORRECTION_KNOB = "train:correction"  # rl's own knob: the loss, not a load setting (spec/knobs.py has those)


def parse_setting(text: str) -> RLSetting:
    """'none' or '' -> nothing aligned or turned; 'rope,swiglu' -> the validated regions in registry order;
    'routing' (a mixture of experts): the update's forward replays the rollout's routes (R3); a SIDE:KEY=VALUE item
    turns a deployment knob (engine:kv_cache_dtype=fp8, train:kernels=liger, train:precision=amp,
    train:correction=tis)."""
    from ..engines import parse_factor

    items = [t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"]
    knobs: dict[str, str] = {}
    for item in (t for t in items if ":" in t):
        name, _, value = item.partition("=")
        if name == CORRECTION_KNOB:
            if value not in CORRECTIONS[1:]:
                raise ProbeError(f"--setting {item!r}: {CORRECTION_KNOB} takes {', '.join(CORRECTIONS[1:])} (none "
                                 "is the run's --correction)")
            label = item
        else:
            label = parse_factor(item).label
        if knobs.get(name, label) != label:
            raise ProbeError(f"--setting {text.strip()!r} sets {name} twice; give a setting one value of a knob")
        knobs[name] = label
    regions = [t for t in items if ":" not in t]
    return RLSetting(parse_regions(",".join(regions)) if regions else (), tuple(knobs[k] for k in sorted(knobs)))


def check_trainer_knobs(arms: list[RLSetting], device: str) -> None:
    """Each setting's trainer knobs (train:kernels=liger) meet the checks their flags meet (--train-kernels liger: the
    device its ops run on, its package installed), before anything loads: after the loads, a missing library would
    cost the loads and end in a traceback. (The engine's knobs are checked where the one engine is built.)"""
    from ..environment import resolve_train_device
    from ..engines import parse_factor

    for arm in arms:
        for label in arm.knobs:
            if label.startswith("train:") and not label.startswith(CORRECTION_KNOB):
                factor = parse_factor(label)
                try:
                    factor.knob.check(factor.value, resolve_train_device(None, device))
                except ProbeError as e:
                    raise ProbeError(f"--setting {arm.name!r}: {e}") from None


# rl's options, in the order --help lists them: (the part that declares the field: "rl" for RLSpec's own, "load" for
# the LoadSpec, "prompts" for the PromptSpec; its name; the help rl gives it where the part's own speaks of compare's
# run rather than rl's; None: the field's own). A part's other fields are not rl's options: RLSpec keeps them at their
# defaults (LoadSpec's dtype is bfloat16, rl's).
RL_FLAGS = (
    ("load", "model", "Checkpoint folder or hub id. Default: the built-in tiny trained Qwen3."),
    ("load", "device", None),
    ("rl", "steps", None),
    ("rl", "align", None),
    ("rl", "setting", None),
    ("rl", "side", None),
    ("load", "engine", "The rollout engine: eager (enforce_eager; regions can be aligned in it) or compiled (vLLM's "
                       "defaults, as RL frameworks deploy it: torch.compile, and CUDA graphs on a GPU; its regions stay "
                       "as shipped, so aligning one needs --side train)."),
    ("rl", "correction", None),
    ("rl", "lr", None),
    ("load", "train_precision", "The trainer's forward and backward: bf16 (on a BF16 copy of the FP32 masters) or amp "
                                "(on the FP32 weights under torch.autocast to BF16, as torch AMP and FSDP mixed "
                                "precision run: norms, residual stream and RoPE in FP32). Either way the engine "
                                "receives the masters rounded to BF16."),
    ("load", "train_kernels", "Kernel set of the trainer's forward and backward: torch (transformers' ops) or liger "
                              "(Liger-Kernel's fused RMSNorm, RoPE and SwiGLU; CUDA only). vllm (the engine's kernels) "
                              "has no backward, so rl refuses it."),
    ("rl", "group_size", None),
    ("rl", "prompts_per_step", None),
    ("prompts", "prompts", "A .txt of prompts (blank-line separated) for --reward; default: the built-in "
                           "bracket-closing task's prompts."),
    ("rl", "reward", None),
    ("rl", "max_new_tokens", None),
    ("rl", "temperature", None),
    ("rl", "clip_eps", None),
    ("rl", "tis_cap", None),
    ("rl", "grad_clip", None),
    ("rl", "no_signal_step", None),
    ("load", "engine_args", "JSON object of extra vllm.LLM keyword arguments (e.g. "
                            "'{\"gpu_memory_utilization\": 0.1}'); prefix caching stays on, as in production."),
    ("rl", "audit_every", None),
    ("load", "seed", "Seed of the first run."),
    ("rl", "seeds", None),
    ("load", "allow_untested_versions", None),
)
PARTS = {"load": LoadSpec, "prompts": PromptSpec}  # RLSpec's components, by field name


def _default(f):
    return f.default_factory() if f.default is MISSING else f.default


SEED_RANGE = "--seed is out of range; use a number from 0 to 2**31 - 1"


def seed_in_range(seed: int, seeds: int) -> bool:
    """Whether every run's seed (seed, seed+1, ... for --seeds runs) is one rl can give torch and vLLM."""
    return 0 <= seed < 2**31 - seeds


def check_engine_args(args: dict) -> None:
    """rl's own reasons for the vllm.LLM keywords it sets itself, asked before the LoadSpec's check, whose reasons
    name compare's flags."""
    from ..engines import stack_class

    owned = stack_class(DEFAULT_INFER).owned_args
    for key, value in args.items():
        if key == "enable_prefix_caching" and value is True:  # what rl sets anyway
            continue
        if key in ENGINE_ARGS_OWNED or key in owned:
            why = ENGINE_ARGS_OWNED.get(key, "rl sets it itself")
            raise ProbeError(f"--engine-args key {key!r}: {why}; drop the key")


def rl_spec(**options) -> "RLSpec":
    """The RLSpec of rl's options by their names (RL_FLAGS: what the CLI passes, what a script may), each handed to
    the part that declares it."""
    part_of = {name: part for part, name, _ in RL_FLAGS}
    unknown = sorted(set(options) - set(part_of))
    if unknown:
        raise ProbeError(f"rl has no option {', '.join(unknown)}; its options: {', '.join(part_of)}")
    given = {part: {n: v for n, v in options.items() if part_of[n] == part} for part in ("rl", *PARTS)}
    if "engine_args" in given["load"]:
        given["load"]["engine_args"] = parse_engine_args(given["load"]["engine_args"])
        check_engine_args(given["load"]["engine_args"])
    seed, seeds = given["load"].get("seed", 0), given["rl"].get("seeds", 1)
    if isinstance(seed, int) and isinstance(seeds, int) and not seed_in_range(seed, seeds):  # not LoadSpec's range
        raise ProbeError(SEED_RANGE)
    return RLSpec(**{name: PARTS[name](**given[name]) for name in PARTS}, **given["rl"])



def regrouped(values):
    """A spec an earlier release recorded flat (rl's options side by side, before RLSpec was composed of its parts),
    as to_dict records it now: each option under the part that declares it, the parts' other fields at their
    defaults, which those runs used (rl had no flag for them). A spec recorded nested, or anything else, is returned
    as it is, for the manifest checks to judge."""
    if not isinstance(values, dict) or "load" in values or "model" not in values:
        return values
    part_of = {name: part for part, name, _ in RL_FLAGS}
    nested = {part: {f.name: _default(f) for f in fields(cls)} for part, cls in PARTS.items()}
    top: dict = {}
    for name, value in values.items():
        (nested[part_of[name]] if part_of.get(name, "rl") != "rl" else top)[name] = value
    return {**top, **nested}

@dataclass(frozen=True, kw_only=True)
class RLSpec:
    """A GRPO run (or an experiment: several settings x seeds) on one checkpoint, one engine."""

    load: LoadSpec = option(default_factory=LoadSpec)
    """The model, the engine and the trainer, as compare loads them (rl takes the options RL_FLAGS names)."""
    prompts: PromptSpec = option(default_factory=PromptSpec)
    """--prompts: the prompt pool's files (default: the built-in task's prompts)."""
    steps: int = option(20, "GRPO steps per run (rollout, reward, update, weight push, checks).")
    align: str = option("none", "Regions aligned (FP32 until one rounding): none or a comma list of "
                                + ", ".join((*ALL_REGIONS, "lm_head", "residual"))
                                + "; routing (MoE) is R3 routing replay: the update's "
                                "forward sends each token to the experts the engine's rollout routed it to, with the "
                                "trainer's own gate weights.")
    setting: tuple[str, ...] = option((), "Experiment: one run per setting (repeat the flag: --setting none "
                                          "--setting rope --setting rope,swiglu,rmsnorm); replaces --align. A "
                                          "setting takes what --align takes (--setting routing, on a mixture of "
                                          "experts, is R3: the engine's expert ids with the trainer's own gate "
                                          "weights) and deployment knobs as SIDE:KEY=VALUE items: "
                                          "train:kernels=liger, train:precision=amp, train:correction=tis|mis, "
                                          "engine:kv_cache_dtype=fp8 (the same engine items in every setting: "
                                          "one engine serves them all), e.g. --setting none --setting "
                                          "train:correction=tis --setting rope,swiglu,rmsnorm,train:kernels=liger.",
                                  repeat=True)
    side: str = option("both", "Where regions are aligned: both (trainer and engine) or train (the engine as shipped).")
    correction: str = option("none", "Off-policy correction of the engine/trainer mismatch: none (PPO ratio against "
                                     "the engine's logprobs), tis (truncated importance weights) or mis (masked).")
    lr: float = option(1e-3, "AdamW learning rate (FP32 master weights).")
    group_size: int = option(8, "Responses sampled per prompt (GRPO's group).")
    prompts_per_step: int = option(4, "Prompts per step, drawn from the prompt pool.")
    reward: str | None = option(None, "brackets (default: 1 when every bracket is closed), letters (dense: the share "
                                      "of the response's characters that are lowercase letters; learns from any "
                                      "weights), or module:function(prompt_text, response_text) -> float.")
    max_new_tokens: int = option(24, "Most tokens per response.")
    temperature: float = option(1.0, "Sampling temperature of the rollouts. Keep 1.0 for an unbiased ratio: the "
                                     "engine reports raw (untempered) logprobs and the trainer computes the same.")
    clip_eps: float = option(0.2, "PPO clip band [1-eps, 1+eps].")
    tis_cap: float = option(2.0, "TIS truncation cap C (MIS keeps weights in [1/C, C]).")
    grad_clip: float = option(1.0, "Gradient norm clip.")
    no_signal_step: str = option("step", "A step where no group has signal (every group's rewards equal, so every "
                                         "advantage is 0): step (call AdamW's step anyway, as TRL and verl do by "
                                         "default; momentum keeps moving the weights) or skip (no backward, no "
                                         "optimizer step: the weights stay as they are).")
    audit_every: int = option(0, "Every N steps, also compare the engine's weights with the trainer's by sha256 on "
                                 "the host (0: never): an independent path beside the exact on-device comparison that "
                                 "every step runs; it copies every weight to the host.")
    seeds: int = option(1, "Runs per setting, with seeds seed, seed+1, ...")

    def __post_init__(self) -> None:
        check_finite(self)
        taken = {part: {name for p, name, _ in RL_FLAGS if p == part} for part in PARTS}
        for part, spec in ((part, getattr(self, part)) for part in PARTS):
            fixed = [f.name for f in fields(spec) if f.name not in taken[part] and getattr(spec, f.name) != _default(f)]
            if fixed:  # a script's spec: the CLI has no flag for them
                raise ProbeError(f"rl does not take {part}.{', '.join(fixed)}; leave {'them' if len(fixed) > 1 else 'it'} "
                                 f"at the default (rl's options: {', '.join(name for _, name, _ in RL_FLAGS)})")
        checks = [
            (self.side in SIDES, f"--side {self.side!r} is not valid; choose one of: {', '.join(SIDES)}"),
            (self.correction in CORRECTIONS, f"--correction {self.correction!r} is not valid; choose one of: "
                                             f"{', '.join(CORRECTIONS)}"),
            (1 <= self.steps <= MAX_STEPS, f"--steps must be from 1 to {MAX_STEPS}"),
            (self.lr > 0, "--lr must be positive"),
            (self.group_size >= 2, "--group-size must be at least 2 (advantages are relative to the group)"),
            (self.group_size <= MAX_GROUP_SIZE, f"--group-size must be at most {MAX_GROUP_SIZE} (GRPO recipes "
                                                "sample 4 to 64 responses per prompt)"),
            (1 <= self.prompts_per_step <= MAX_PROMPTS_PER_STEP, f"--prompts-per-step must be from 1 to "
                                                                 f"{MAX_PROMPTS_PER_STEP}"),
            (self.group_size * self.prompts_per_step <= MAX_RESPONSES_PER_STEP,
             f"--group-size x --prompts-per-step is {self.group_size * self.prompts_per_step} responses per step; the "
             f"trainer scores them in one batch, so keep it at most {MAX_RESPONSES_PER_STEP}"),
            (1 <= self.max_new_tokens <= MAX_NEW_TOKENS, f"--max-new-tokens must be from 1 to {MAX_NEW_TOKENS}"),
            (self.temperature > 0, "--temperature must be > 0 (a policy gradient needs sampling)"),
            (0 < self.clip_eps < 1, "--clip-eps must be in (0, 1)"),
            (self.tis_cap > 1, "--tis-cap must be > 1"),
            (self.grad_clip > 0, "--grad-clip must be positive"),
            (self.no_signal_step in NO_SIGNAL_STEPS, f"--no-signal-step {self.no_signal_step!r} is not valid; choose "
                                                     f"one of: {', '.join(NO_SIGNAL_STEPS)}"),
            (self.audit_every >= 0, "--audit-every must be 0 (never) or a number of steps"),
            (1 <= self.seeds <= MAX_SEEDS, f"--seeds must be from 1 to {MAX_SEEDS} (each seed is a whole run per "
                                           "setting)"),
            (seed_in_range(self.load.seed, self.seeds), SEED_RANGE),
            (not (self.setting and self.align != "none"), "--align and --setting both given; use --setting for "
                                                          "several settings, --align for one"),
        ]
        for ok, message in checks:
            if not ok:
                raise ProbeError(message)
        object.__setattr__(self, "setting", tuple(self.setting))
        check_engine_args(self.load.engine_args)  # rl_spec asked first; a spec built whole is asked here
        from ..engines import stack_class

        if self.load.train_kernels != SHIPPED_KERNELS:
            stack_class(DEFAULT_TRAIN).kernel_set(self.load.train_kernels).check_backward()
        arms = [parse_setting(s) for s in (self.setting or (self.align,))]
        seen: dict[RLSetting, str] = {}
        for text, arm in zip(self.setting, arms):
            # a setting is a set of regions and knobs: 'swiglu,rope' is 'rope,swiglu', and two runs of one name
            # would be read (rl_summary.csv, the report) as one setting with twice the runs
            if arm in seen:
                again = "given twice" if text.strip() == seen[arm].strip() else (
                    f"again (--setting {seen[arm].strip()!r}: the same regions and knobs, in another order)")
                raise ProbeError(f"--setting {text.strip()!r} is the setting {arm.name!r} {again}; give each setting "
                                 "once (--seeds repeats a setting)")
            seen[arm] = text
        flag = "--setting" if self.setting else "--align"
        for arm in arms:  # a region a stack's class does not align, before anything loads (as compare refuses it)
            refusal = unaligned(arm.regions, self.load, self.side, named=STACKS_NAMED, leave_out_of=flag, sides=SIDES)
            if refusal:
                raise ProbeError(f"{flag} {arm.name!r}: {refusal}")
        for arm in arms:
            kernels = arm.value("train:kernels")
            if kernels is not None:
                stack_class(DEFAULT_TRAIN).kernel_set(kernels).check_backward()
        engines = {arm.engine_knobs for arm in arms}
        if len(engines) > 1:  # one process holds one vLLM engine (engines/vllm/stack.py), and rl's settings share it
            shown = " vs ".join(",".join(e) or "the engine as given" for e in sorted(engines))
            raise ProbeError(f"--setting values run on different engines ({shown}); an rl run has one engine, so give "
                             "every setting the same engine:KEY=VALUE items and run each engine configuration as an rl "
                             "run of its own (several fit side by side on one GPU with gpu_memory_utilization)")
        check_trainer_knobs(arms, self.load.device)
        if self.load.engine_args.get("quantization") is not None or any(k.startswith("engine:quantization=") for e in engines for k in e):
            # the trainer pushes BF16 weights every step
            raise ProbeError("engine quantization (--engine-args or --setting): rl pushes the trainer's BF16 weights "
                             "into the engine every step, which a quantized engine would have to re-quantize; drop it "
                             "(measure FP8 weights with compare or ablate --factor engine:quantization=fp8)")
        if "compilation_config" in self.load.engine_args and self.load.engine == "eager":
            raise ProbeError("--engine-args compilation_config needs --engine compiled (the eager engine compiles "
                             "nothing); add --engine compiled or drop the key")
        for s in self.settings:
            # routing comes from the engine, lm_head runs outside the compiled graph: neither needs a build of its own
            patched = [r for r in parse_setting(s).regions
                       if not (get_region(r).from_engine or get_region(r).outside_graph)]
            if patched and self.load.engine == "compiled" and self.side == "both":
                # every setting runs on one engine, built once; a compiled engine takes a region only when built
                # with it (compare builds one per combination: engines/vllm/aligned.py), rl reuses one across settings
                raise ProbeError(f"--engine compiled cannot align {','.join(patched)} on the engine (setting {s!r}): "
                                 "rl runs every setting on one engine, and a compiled engine takes a region patch "
                                 "only when it is built; use --side train (the engine as deployed) or --engine eager")

    @property
    def settings(self) -> tuple[str, ...]:
        """The runs' settings as names ('none', 'rope', 'rope,swiglu,rmsnorm'), in the order given."""
        raw = self.setting or (self.align,)
        return tuple(parse_setting(s).name for s in raw)

    @property
    def engine_knobs(self) -> tuple[str, ...]:
        """The engine knobs every setting turns (one engine serves them all: __post_init__ checks they agree)."""
        return parse_setting(self.settings[0]).engine_knobs

    @property
    def seed_list(self) -> tuple[int, ...]:
        return tuple(range(self.load.seed, self.load.seed + self.seeds))

    @staticmethod
    def option_fields() -> list:
        """The Field that declares each of rl's options (RL_FLAGS), in --help's order."""
        owners = {"rl": RLSpec, **PARTS}
        return [next(f for f in fields(owners[part]) if f.name == name) for part, name, _ in RL_FLAGS]

    def options(self) -> dict:
        """rl's options by name (RL_FLAGS), read from the parts that declare them: what rl_spec takes back."""
        return {name: getattr(self if part == "rl" else getattr(self, part), name) for part, name, _ in RL_FLAGS}

    def to_dict(self) -> dict:
        """The spec as plain JSON data (the manifest's `spec`): rl's own fields, the load and the prompts nested."""
        return asdict(self)
