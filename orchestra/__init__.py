"""orchestra: multi-agent pipelines over one long document on a family of LLMs, prefilling it once.

Heavy dependencies (torch, transformers) load only when a name that needs them is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestra.errors import (
    CorruptGGUFError,
    FamilyBuildError,
    FamilyError,
    FamilyHomeError,
    GGUFUnavailableError,
    MemberNotFoundError,
    OrchestraError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "build_family",
    "load_family",
    "FamilyManifest",
    "OrchestraError",
    "FamilyError",
    "FamilyHomeError",
    "FamilyBuildError",
    "GGUFUnavailableError",
    "CorruptGGUFError",
    "MemberNotFoundError",
]

if TYPE_CHECKING:
    from orchestra.family import FamilyManifest, build_family, load_family

_LAZY = {"build_family": "orchestra.family", "load_family": "orchestra.family", "FamilyManifest": "orchestra.family"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'orchestra' has no attribute {name!r}")
