"""A package face whose names load their module on first use (so that importing the package loads none of them):
`__getattr__, __dir__ = lazy_exports(__name__, {name: module}, globals())`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str], names: dict) -> tuple[Callable, Callable]:
    """The module-level __getattr__ (a name's module imported on first use) and __dir__ of `package`, whose own
    `names` (its globals()) are listed beside `exports`."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(names) | set(exports))

    return __getattr__, __dir__
