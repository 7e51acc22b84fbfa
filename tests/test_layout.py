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
