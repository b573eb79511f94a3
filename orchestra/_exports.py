"""Lazy re-exports for packages' ``__init__`` modules: a public name loads its module on first use.

A package lists its public names at its top (``from orchestra.runs import Orchestra``) without making
``import orchestra.runs.checkpoint`` load the scheduler, anyio and the cache core: the names resolve
through the module ``__getattr__`` this returns, and type checkers read the matching imports under
``TYPE_CHECKING``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, modules: Mapping[str, tuple[str, ...]]) -> Callable[[str], object]:
    """The ``__getattr__`` of `package`, serving each name in `modules` (module path -> its names)."""
    owner = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> object:
        module = owner.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
