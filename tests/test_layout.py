"""The package's architecture rules, checked on the source: layers point down, names do not collide."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "divergence_probe"
ABOVE_STACKS = {"spec", "runs", "cli", "reports", "rl"}


def imported_modules(path: Path) -> set[str]:
    """First component under divergence_probe of every module `path` imports (relative or absolute)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = path.parent.relative_to(PACKAGE).parts[: len(path.parent.relative_to(PACKAGE).parts) - (node.level - 1)]
                parts = [*base, *(node.module or "").split(".")] if node.module else [*base]
                parts = [p for p in parts if p] or [a.name for a in node.names]
            elif node.module and node.module.startswith("divergence_probe"):
                parts = node.module.split(".")[1:] or [a.name for a in node.names]
            else:
                continue
            names.add(parts[0])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("divergence_probe.")}
    return names


def test_models_stacks_and_regions_import_nothing_above_them():
    for folder in ("models", "engines", "regions"):
        paths = list((PACKAGE / folder).rglob("*.py"))  # engines/vllm/ too
        assert paths
        for path in paths:
            assert not imported_modules(path) & ABOVE_STACKS, path


def test_the_core_never_imports_presentation():
    for path in PACKAGE.glob("*.py"):
        if path.stem != "cli" and path.stem != "__init__":
            assert "reports" not in imported_modules(path), path


def test_no_module_and_package_share_a_stem():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert not modules & packages
    assert not {m for m in modules if m + "s" in packages or m.rstrip("s") in packages}


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
