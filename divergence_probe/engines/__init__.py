"""Stack registry. A new stack (SGLang, Megatron) is one package plus one line here, or a package of its own that
names its class in an entry point of the group `divergence_probe.stacks` (ENTRY_POINTS) when it is installed.

Entries are "module:Class" strings so a heavy engine is imported only when it is chosen. The class an entry hands out
declares what it can do (`declare`) and owns its pre-load policy (protocol.StackClass): its settings check, knobs,
replayable args, load plan and the variant it builds for given settings (`for_settings`). Outside engines/, only this
module and protocol.py are imported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from importlib import import_module

from ..errors import ProbeError, StackError, one_line
from ..signals import Stopped

# The types below are engines/protocol.py's (Capabilities, Knob, Stack, StackClass); the registry does not import them,
# so that a spec asking it for a class sits no deeper in the import graph than the registry itself.

STACKS: dict[str, str] = {
    "vllm": "divergence_probe.engines.vllm.stack:VLLMStack",
    "hf": "divergence_probe.engines.hf.trainer:HFStack",
    "recorded": "divergence_probe.engines.recorded.stack:RecordedStack",  # score's inference side: a file, no flag
}
SHARDED: dict[str, str] = {  # the same stack over several processes (tensor parallel), where it has such a class
    "vllm": "divergence_probe.engines.vllm.tensor_parallel:TensorParallelStack",
    "hf": "divergence_probe.engines.hf.tensor_parallel:ShardedHFStack",
}
WORKERS: dict[str, str] = {  # the same stack built with regions in a worker process of its own (StackClass.workers)
    "vllm": "divergence_probe.engines.vllm.worker:WorkerStack",
}
INFER_STACKS = ["vllm", "hf"]  # may sit on the inference side of a comparison
TRAIN_STACKS = ["hf"]  # may sit on the training side (a trainer's forward: transformers)
SHIPPED = frozenset(STACKS)  # the names an installed stack may not take
SIDE_LISTS = {"infer": INFER_STACKS, "train": TRAIN_STACKS}

ENTRY_POINTS = "divergence_probe.stacks"
"""The entry-point group of the stacks other packages install: name = "module:Class", the registry's own format.

    [project.entry-points."divergence_probe.stacks"]
    my-engine = "my_engine.stack:MyEngineStack"

The sides an installed stack sits on are its class's declaration (StackClass.sides), not its entry point's: the class
is where a stack declares all it can do before it loads (declare, aligns, knobs), and the entry point's value stays
the registry's own string, as it would not with extras (which mean optional dependencies, and which the entry-point
specification no longer recommends). The price: an installed stack's sides are known only once it is chosen and its
class imported, so until then its name is offered on both sides, and a side its class does not declare is refused in
one line when it is chosen (`check_side`)."""


def register_stack(name: str, target: str, sides: tuple[str, ...] = ("infer", "train")):
    """Add a stack ("module:Class") on the given sides; returns a function that removes it again (tests use this
    for a toy stack; a stack that ships with the tool is a line in STACKS instead)."""
    STACKS[name] = target
    lists = [lst for side, lst in SIDE_LISTS.items() if side in sides]
    for lst in lists:
        lst.append(name)

    def unregister() -> None:
        STACKS.pop(name, None)
        for lst in lists:
            lst.remove(name)

    return unregister


@cache
def _entry_points() -> tuple:
    """The installed packages' entry points of ENTRY_POINTS (importlib.metadata.EntryPoint), read from their metadata
    once per process, when a list of stacks or a stack is first asked for; no module of theirs is imported."""
    from importlib.metadata import entry_points

    return tuple(entry_points(group=ENTRY_POINTS))


def _package(entry) -> str:
    """The installed package an entry point comes from, as pip names it."""
    return f"{entry.dist.name} {entry.dist.version}"


def installed_stacks() -> dict:
    """The stacks installed packages add, by name -> their entry point. A name the tool ships (or that two packages
    both take) is refused in one line: an installed stack never shadows a shipped one, nor one package another."""
    found = {}
    for entry in _entry_points():
        if entry.name in found and (_package(found[entry.name]), found[entry.name].value) == (_package(entry),
                                                                                              entry.value):
            continue  # the same package's entry listed twice in its metadata: one stack
        if entry.name in SHIPPED or entry.name in found:
            taken = ("a stack the tool ships" if entry.name in SHIPPED
                     else f"the stack {_package(found[entry.name])} adds")
            raise ProbeError(f"{_package(entry)} adds a stack named {entry.name!r} ({ENTRY_POINTS} entry point), "
                             f"the name of {taken}; rename its entry point and its class's `name`, or uninstall it")
        found[entry.name] = entry
    return found


def installed_names() -> list[str]:
    """The names of the stacks installed packages add, as listed (options' help, a line listing the stacks): this
    refuses nothing, so that --help shows what is installed; a run reading the registry refuses a clashing name
    (`installed_stacks`), which the list leaves out."""
    return [name for name in dict.fromkeys(entry.name for entry in _entry_points()) if name not in STACKS]


def stacks_on(side: str) -> list[str]:
    """The stacks that may be chosen for `side` ("infer", "train"): the registry's on that side, then every installed
    one (its class says which sides it sits on once it is chosen: `check_side`)."""
    return SIDE_LISTS[side] + installed_names()


def check_side(name: str, side: str, flag: str) -> None:
    """Refuse in one line an installed stack chosen for a side its class does not declare (StackClass.sides): only
    its class knows (ENTRY_POINTS); the registry's own stacks are listed on their sides."""
    if name in SIDE_LISTS[side]:
        return
    cls = stack_class(name)
    if side not in cls.sides:
        others = [other for other in stacks_on(side) if other != name]
        raise ProbeError(f"{flag} {name}: {cls.title or name} does not sit on the {side} side (its class's sides: "
                         f"{', '.join(cls.sides) or 'none'}); choose one of: {', '.join(others)}")


def stack_class(name: str, ranks: int = 1, *, worker: bool = False):
    """The class of a stack by registry name, at `ranks` processes (`worker`: its worker-process variant); imported,
    never instantiated (no engine library is imported: every stack imports its engine when it loads). A caller
    that has settings asks `stack_class(name).for_settings(settings)` for the variant they need. An installed stack
    has one class, which builds its own variants."""
    installed = installed_stacks()  # read for every stack: a name clash is refused whichever stacks a run chose
    if name in STACKS:
        entry = WORKERS[name] if worker else SHARDED[name] if ranks > 1 and name in SHARDED else STACKS[name]
        module, cls = entry.split(":")
        return getattr(import_module(module), cls)
    if name not in installed:
        raise ProbeError(f"unknown stack {name!r}; choose one of: {', '.join([*STACKS, *installed])}")
    entry = installed[name]
    try:
        cls = entry.load()
    except Stopped:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever another package's module raises (an exit too) as
        # it imports, it did not import
        raise StackError(f"the stack {name!r} that {_package(entry)} adds did not import ({entry.value}: "
                         f"{type(e).__name__}: {one_line(e, 200)}); fix or reinstall that package, or uninstall "
                         "it") from e
    # What another package hands over is checked, not trusted: a class that names itself (StackClass.name, a
    # string; engines.protocol.StackPolicy's subclasses do), under the name its entry point gives it, since the class
    # names itself when its variants and patches are looked up
    if not (isinstance(cls, type) and isinstance(getattr(cls, "name", None), str)):
        raise StackError(f"the stack {name!r} that {_package(entry)} adds names {entry.value}, which is not a stack "
                         "class (a subclass of engines.protocol.StackPolicy); fix or reinstall that package, or "
                         "uninstall it")
    if cls.name != name:
        raise StackError(f"the stack {name!r} that {_package(entry)} adds is the class {entry.value}, whose name is "
                         f"{cls.name!r}; an entry point's name is its class's `name`: fix or reinstall that package, "
                         "or uninstall it")
    return cls


def knobs_of(infer: str | None = None, train: str | None = None, *, installed: bool = True) -> dict:
    """The deployment knobs, by name (`engine:kv_cache_dtype`): the engine side's of the inference stacks, the
    training side's of the trainers, each marked with the stack that owns it (the first that declares the name);
    `infer`/`train`: those stacks only; `installed`: the installed stacks' too (reading them imports their classes,
    which import no engine)."""
    def on(side: str, chosen: str | None) -> list[str]:
        return [chosen] if chosen else stacks_on(side) if installed else SIDE_LISTS[side]

    found = {}
    for side, names in (("engine", on("infer", infer)), ("train", on("train", train))):
        for name in names:
            for knob in stack_class(name).knobs().values():
                if knob.side == side:
                    found.setdefault(knob.name, replace(knob, owner=name))
    return found


# Deployment knobs as ablation factors (`--factor SIDE:KEY=VALUE`, spec/knobs.py): a factor is one value of a knob a
# stack declares, read here against the knobs the registry's stacks declare.
FACTOR_SIDES = ("engine", "train")


@dataclass(frozen=True)
class Factor:
    knob: object  # engines.protocol.Knob, as the stack that owns it declares it
    value: str

    @property
    def label(self) -> str:
        """How combinations and the attribution name it: engine:kv_cache_dtype=fp8."""
        return f"{self.knob.name}={self.value}"


def parse_factor(text: str, infer: str | None = None, train: str | None = None) -> Factor:
    """'engine:kv_cache_dtype=fp8' -> its Factor; anything else is one line naming what a factor looks like.
    `infer` and `train`: the run's stacks, whose knobs alone it is read against (an installed stack may declare a knob
    of a name a shipped one has). Without them, the shipped stacks' knobs first and the installed ones' only for a
    name none of those has, so a package that does not import stops only a run that asks for its knob."""
    name, eq, value = text.strip().partition("=")
    knobs = knobs_of(infer, train) if infer and train else knobs_of(installed=False)
    if name not in knobs and not (infer and train):
        knobs = knobs_of()
    if not eq or name not in knobs:
        side = name.partition(":")[0]
        hint = f"knobs: {', '.join(knobs)}" if side in FACTOR_SIDES else "a region goes in --regions"
        raise ProbeError(f"--factor {text.strip()!r} is not SIDE:KEY=VALUE of a known knob ({hint}), e.g. "
                         "engine:kv_cache_dtype=fp8 or train:kernels=vllm")
    knob = knobs[name]
    if value not in knob.values:
        raise ProbeError(f"--factor {name}={value!r}: {name} takes {', '.join(knob.values)}")
    return Factor(knob, value)


def parse_factors(texts) -> tuple[str, ...]:
    """--factor's values (repeated, each possibly a comma list) -> the factors' labels, checked, without repeats;
    two values of one knob cannot both be factors (a combination would set it twice)."""
    items = [t for text in ([texts] if isinstance(texts, str) else list(texts or ())) for t in text.split(",") if t.strip()]
    factors = [parse_factor(t) for t in items]
    seen: dict[str, str] = {}
    for f in factors:
        if seen.get(f.knob.name, f.label) != f.label:
            raise ProbeError(f"--factor {seen[f.knob.name]} and {f.label} set the same knob; ablate one value of a "
                             "knob at a time")
        seen[f.knob.name] = f.label
    return tuple(dict.fromkeys(f.label for f in factors))


def capabilities_of(name: str, *, engine: str = "eager", ranks: int = 1):
    """What a stack declares it can do (protocol.Capabilities), before anything loads: what a spec check asks."""
    return stack_class(name, ranks).declare(engine, ranks)


def get_stack(name: str):
    """A fresh, unloaded stack instance by registry name."""
    return stack_class(name)()


__all__ = ["STACKS", "SHARDED", "WORKERS", "INFER_STACKS", "TRAIN_STACKS", "SIDE_LISTS", "ENTRY_POINTS", "Factor",
           "capabilities_of", "check_side", "get_stack", "installed_names", "installed_stacks", "knobs_of",
           "parse_factor", "parse_factors", "register_stack", "stack_class", "stacks_on"]
