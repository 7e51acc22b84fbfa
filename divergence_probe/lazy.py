"""Names a package exports but imports on first use (PEP 562), so importing the package stays light: the CLI's
--help reads it without torch.

    __getattr__, __dir__ = lazy_exports(__name__, globals(), {"load": ".probe", ...})
"""

from __future__ import annotations

from importlib import import_module


def lazy_exports(package: str, namespace: dict, names: dict[str, str]):
    """The package's module __getattr__ and __dir__ for `names` (name -> the relative module defining it)."""

    def __getattr__(name: str):
        if name in names:
            value = getattr(import_module(names[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
