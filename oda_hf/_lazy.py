"""Lazy package exports (PEP 562): importing a package stays cheap (no torch/transformers) until one of
its public names is used, so `oda --help` and light submodules start fast."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, str]):
    """Module-level ``__getattr__`` and ``__dir__`` for `package`.

    `exports` maps each public name to the submodule that defines it (relative, e.g. ``".modeling"``).
    A name is imported on first access and then cached in the package's namespace.
    """

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
