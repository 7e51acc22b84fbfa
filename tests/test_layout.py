"""The package's architecture, checked on the source: layers point down, no import cycles, no long chains of imports,
no module and package sharing a stem. Every import counts, the lazy ones inside functions included: a lazy import
only postpones the dependency, it does not remove it."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "divergence_probe"

# Top to bottom. A module may import its own layer and the layers below it, never one above. Each entry is a
# subpackage or a module of divergence_probe ("" is the package's own __init__.py); the longest entry that holds a
# module decides its layer.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("the command line", frozenset({"", "__main__", "cli"})),
    ("the runs", frozenset({"runs", "rl"})),
    ("reports of run folders", frozenset({"reports"})),
    ("the run specs", frozenset({"spec"})),
    ("engines and trainers", frozenset({"engines", "align"})),
    ("engine-neutral models, regions, numerics and rollout files", frozenset({"models", "regions", "numerics",
                                                                                 "rollouts"})),
    ("base modules", frozenset({"errors", "lazy", "options", "taps", "tap_selection", "tokenized", "prompts",
                                "environment", "rundir", "versions", "signals", "quiet", "timings", "run_folder",
                                "home", "rl_choices",
                                "engines.hooks"})),  # the conflict-checked hook set every patch goes through
)
# The most modules one chain of imports may pass through (__main__ -> cli -> ... -> errors counts every link). The
# command line's own modules count as one link (cli), the layer it is: a command calls the API through its shared
# helpers, and those hops are capped on their own (LONGEST_CLI_CHAIN).
# The API's lazy names (the package's _LAZY table) are links like any import. Target 8, not reached: the command line
# reaches every run through the API's one run entry, runs.probe (it sends each run kind to its runner), an ablation is
# made of compares, and a compare reads the whole run spec (spec.run -> spec.generate -> spec.fields -> options). rl's
# loop is as long: it loads through runs.loading, which reads the run spec too.
LONGEST_CHAIN = 9  # __main__ -> cli -> runs.probe -> runs.ablate -> runs.compare -> spec.run -> spec.generate ->
#                    spec.fields -> options
LONGEST_CLI_CHAIN = 5  # cli.app -> a command -> a command it runs again (rerun -> score) -> runner -> console
CLI = "divergence_probe.cli"
# Lines a file may have: one concept per file, readable top to bottom. The command line is a shell over the API, so
# its files are held shorter.
MOST_LINES, MOST_CLI_LINES = 600, 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _absolute(target: str, package: str) -> str:
    """`target` (".x", "..y.z" or absolute) as seen from `package`, as `from target import ...` there resolves it."""
    level = len(target) - len(target.lstrip("."))
    if not level:
        return target
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join([*base, *([target[level:]] if target[level:] else [])])


@cache
def lazy_table(package: str) -> dict[str, str]:
    """The names `package` exports through its lazy table (_LAZY in its __init__.py, read by lazy.lazy_exports on
    first use) -> the module defining each. `dp.load` imports runs.probe as surely as `from .runs.probe import load`
    does, so every such name is an edge of the graph."""
    path = modules().get(package)
    if path is None or path.name != "__init__.py":
        return {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["_LAZY"]:
            # a dict display of string constants, names spread in from a comprehension over a tuple of them
            table = eval(compile(ast.Expression(node.value), str(path), "eval"), {"__builtins__": {}})
            return {name: _absolute(target, package) for name, target in table.items()}
    return {}


def imports_in(source: str, package: str) -> set[str]:
    """The package's modules that `source` (a module of `package`) imports anywhere: at module level or inside a
    function. `from .x import y` is x, or x.y where y is a module; `from . import y` is y. A name of a package's lazy
    table is the module defining it: `from .. import load`, or `dp.load` after `import divergence_probe as dp`."""
    found = set()
    tree = ast.parse(source)
    aliases = {}  # a name bound to a package with a lazy table -> that package
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            submodules = {f"{target}.{a.name}" for a in node.names} & modules().keys()
            found |= submodules
            lazy = {lazy_table(target)[a.name] for a in node.names if a.name in lazy_table(target)}
            found |= lazy
            if len(submodules) + len(lazy) < len(node.names):
                found.add(target)
            aliases |= {a.asname or a.name: name for a in node.names if lazy_table(name := f"{target}.{a.name}")}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
            aliases |= {name: module for a in node.names if lazy_table(module := a.name if a.asname else
                                                                        a.name.split(".")[0])
                        for name in [a.asname or module]}
    used = [(aliases[node.value.id], node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases]
    found |= {lazy_table(package_)[name] for package_, name in used if name in lazy_table(package_)}
    # a package used for its lazy table alone is the modules of the names it uses: the table is no link of its own
    found -= set(aliases.values()) - {package_ for package_, name in used if name not in lazy_table(package_)}
    return found & modules().keys()


@cache
def graph() -> dict[str, frozenset[str]]:
    edges = {}
    for name, path in modules().items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        own = set(lazy_table(name).values())  # a package's lazy table: each of its names imports its module
        edges[name] = frozenset((imports_in(path.read_text(), package) | own) - {name})
    return edges


def layer_of(name: str) -> int:
    """Index in LAYERS of the module `name` (divergence_probe.runs.compare -> the runs)."""
    inside = name.split(".")[1:]
    for length in range(len(inside), 0 if inside else -1, -1):  # "" is the package's __init__ alone
        entry = ".".join(inside[:length])
        for index, (_, members) in enumerate(LAYERS):
            if entry in members:
                return index
    raise AssertionError(f"{name} is in no layer; add its folder or module to LAYERS in tests/test_layout.py")


def test_every_subpackage_and_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_layers_point_down():
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a, targets in graph().items() for b in sorted(targets) if layer_of(b) < layer_of(a)]
    assert not upward, "\n".join(upward)


def test_the_check_sees_lazy_imports():
    """An import inside a function is an edge like one at module level, and `from . import x` names the module x."""
    lazy = "def check():\n    from ..engines import get_stack\n    from . import run\n"
    assert imports_in(lazy, "divergence_probe.spec") == {"divergence_probe.engines", "divergence_probe.spec.run"}


def test_the_check_sees_the_lazy_api_table():
    """A name of a package's lazy table is an edge to the module defining it: from the package itself, from
    `dp.load` after `import divergence_probe as dp`, and from `from .. import write_report`."""
    assert {"divergence_probe.runs.probe", "divergence_probe.reports"} <= graph()["divergence_probe"]
    source = "import divergence_probe as dp\n\ndef f():\n    from .. import write_report, rl\n    dp.load(rl.run)\n"
    assert imports_in(source, "divergence_probe.cli") == {
        "divergence_probe.runs.probe", "divergence_probe.reports", "divergence_probe.rl.experiment"}


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a set of modules in a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph()[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph():
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert not _cycles(), _cycles()


def _longest_chain(edges: dict[str, frozenset[str]]) -> tuple[str, ...]:
    @cache
    def longest(v: str) -> tuple[str, ...]:
        return max(((v, *longest(w)) for w in edges[v]), key=len, default=(v,))

    return max((longest(v) for v in edges), key=len)


def _the_cli_as_one(name: str) -> str:
    return CLI if name.startswith(CLI + ".") else name


def test_longest_chain_of_imports():
    assert not _cycles()  # the chains are finite only without cycles
    edges: dict[str, set[str]] = {}
    for v, targets in graph().items():
        edges.setdefault(_the_cli_as_one(v), set()).update(_the_cli_as_one(w) for w in targets)
    chain = _longest_chain({v: frozenset(targets - {v}) for v, targets in edges.items()})
    assert len(chain) <= LONGEST_CHAIN, " -> ".join(chain)


def test_longest_chain_inside_the_command_line():
    inside = {v: frozenset(w for w in targets if w.startswith(CLI + "."))
              for v, targets in graph().items() if v.startswith(CLI + ".")}
    chain = _longest_chain(inside)
    assert len(chain) <= LONGEST_CLI_CHAIN, " -> ".join(chain)


def test_no_file_is_too_long():
    long = []
    for path in PACKAGE.rglob("*.py"):
        name, lines = path.relative_to(PACKAGE).as_posix(), len(path.read_text().splitlines())
        cap = MOST_CLI_LINES if name.startswith("cli/") else MOST_LINES
        if lines > cap:
            long.append(f"{name}: {lines} lines, more than {cap}")
    assert not long, "\n".join(long)


def test_no_module_and_package_share_a_stem():
    modules_here = {p.stem for p in PACKAGE.glob("*.py")}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert not modules_here & packages
    assert not {m for m in modules_here if m + "s" in packages or m.rstrip("s") in packages}


def test_only_the_vllm_engine_imports_vllm():
    """vLLM is the vLLM engine's business: everything else reaches it through the engine's protocols. Every import
    counts, a lazy one inside a function too."""
    engine = PACKAGE / "engines" / "vllm"
    importers = []
    for path in PACKAGE.rglob("*.py"):
        if engine in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            importers += [f"{path.relative_to(PACKAGE)}:{node.lineno}" for n in names if n.split(".")[0] == "vllm"]
    assert not importers, importers


def engine_imports(path: Path, package: str | None = None) -> set[str]:
    """Every module `path` imports that is an engine's (divergence_probe.engines..., vllm...), at any depth: a lazy
    import inside a function counts. `package`: the dotted package the file is in (by default, where it lies)."""
    found = set()
    package = package or ".".join(path.parent.relative_to(PACKAGE.parent).parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("divergence_probe.engines") or n.split(".")[0] == "vllm"}
    return found


def test_models_and_regions_are_engine_neutral():
    """Families and regions describe the model and the aligned math; where an engine keeps a module, reads a tap or
    takes a patch is the engine's (engines/<engine>/layouts.py and patches/), so neither package imports an engine
    and a Family has no field per engine."""
    import dataclasses

    from divergence_probe.engines import STACKS
    from divergence_probe.engines import layouts
    from divergence_probe.models import FAMILIES, Family, get_family

    for folder in ("models", "regions"):
        paths = list((PACKAGE / folder).rglob("*.py"))
        assert paths
        for path in paths:
            assert not engine_imports(path), (path, engine_imports(path))
    layout_types = {name for name, value in vars(layouts).items() if dataclasses.is_dataclass(value)}
    assert {"Seam", "StackLayout"} <= layout_types
    for field in dataclasses.fields(Family):
        assert field.name not in STACKS, field.name  # a layout per engine, as Family.hf/Family.vllm were
        assert not set(str(field.type).replace("|", " ").replace("[", " ").replace("]", " ").replace(",", " ")
                       .replace('"', " ").split()) & layout_types, field
    for model_type in FAMILIES:
        values = [getattr(get_family(model_type), f.name) for f in dataclasses.fields(Family)]
        assert not [v for v in values if type(v).__module__ == layouts.__name__], model_type


def test_the_engine_neutrality_check_sees_lazy_and_relative_imports(tmp_path):
    """The check must be able to fail: a relative import of an engine inside a function is found."""
    path = tmp_path / "probe.py"
    path.write_text("from .base import Region\n\ndef f():\n    from ..engines.hooks import Replacement\n"
                    "    from ..engines import patching\n    import vllm.config\n")
    assert engine_imports(path, "divergence_probe.regions") == {"divergence_probe.engines.hooks",
                                                                "divergence_probe.engines", "vllm.config"}


# The modules of engines/ that code outside it may import: the registry and the protocols every stack meets, and the
# engine-neutral machinery every stack shares (the conflict-checked hook set, region patching over any stacks, the
# trainer's torch numerics state, an alternate placement's kept engine outputs, the peak memory and the time a stack's
# work takes in its process). An engine's own package is never among them: what a caller needs of an engine before it loads is its
# class's (protocol.StackClass).
ENGINE_DOORS = frozenset({"divergence_probe.engines", "divergence_probe.engines.protocol",
                          "divergence_probe.engines.rollout_protocol"})
ENGINE_SHARED = frozenset({"divergence_probe.engines.hooks", "divergence_probe.engines.patching",
                           "divergence_probe.engines.torch_state", "divergence_probe.engines.kept",
                           "divergence_probe.engines.peak", "divergence_probe.engines.elapsed"})


def engine_doors_crossed(edges: dict[str, frozenset[str]]) -> list[str]:
    """Every import from outside engines/ of a module of engines/ that is neither a door nor shared machinery."""
    inside = "divergence_probe.engines"
    return [f"{a} imports {b}" for a, targets in sorted(edges.items()) if not (a == inside or a.startswith(inside + "."))
            for b in sorted(targets) if (b == inside or b.startswith(inside + "."))
            and b not in ENGINE_DOORS | ENGINE_SHARED]


def test_outside_engines_only_the_registry_and_the_protocols_are_imported():
    """A second engine is one package under engines/ and one registry line: nothing outside engines/ imports an
    engine's modules, lazily inside a function neither."""
    assert not engine_doors_crossed(graph()), "\n".join(engine_doors_crossed(graph()))


def test_the_engine_door_check_sees_a_lazy_import_of_an_engines_module():
    source = "def plan():\n    from ..engines.vllm.policy import ranks_of\n    from ..engines import stack_class\n"
    edges = {"divergence_probe.runs.loading": frozenset(imports_in(source, "divergence_probe.runs")
                                                        | {"divergence_probe.engines.vllm.policy"})}
    assert engine_doors_crossed(edges) == ["divergence_probe.runs.loading imports divergence_probe.engines.vllm.policy"]


ENGINE_NAMES = frozenset({"vllm", "hf"})


def engine_name_comparisons(source: str) -> list[int]:
    """The lines of `source` that compare something against an engine's registry name ("vllm", "hf"): ==, !=, in,
    not in, a match case. What an engine can or cannot do is its declared capability, never a branch on its name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            values = [v for o in operands for v in ([*o.elts] if isinstance(o, (ast.Tuple, ast.List, ast.Set))
                                                    else [o])]
            if any(isinstance(v, ast.Constant) and v.value in ENGINE_NAMES for v in values):
                found.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) \
                and node.value.value in ENGINE_NAMES:
            found.append(node.lineno)
    return found


def test_no_engine_name_branches_outside_engines():
    branches = [f"{path.relative_to(PACKAGE)}:{line}" for path in PACKAGE.rglob("*.py")
                if (PACKAGE / "engines") not in path.parents for line in engine_name_comparisons(path.read_text())]
    assert not branches, branches


def test_the_engine_name_check_sees_each_form_of_comparison():
    source = ('a = infer == "vllm"\nb = "hf" != train\nc = x in (None, "vllm")\nd = y not in ["hf"]\n'
              'match e:\n    case "vllm":\n        pass\nf = g == "vllm-cpu"\nh = {"vllm": 1}\n')
    assert engine_name_comparisons(source) == [1, 2, 3, 4, 6]

