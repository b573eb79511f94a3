"""The bundled model family: SmolLM2-135M-Instruct and members derived from it by project code.

Names load lazily: reading a built family (``load_family``, ``FamilyManifest``: in
:mod:`orchestra.family.manifest`) never imports the build and training code of
:mod:`orchestra.family.build` (gguf, peft behind it); ``build_family``, ``MEMBERS`` and
``MemberSpec`` do. Runtime code imports from ``orchestra.family.manifest`` directly, so the
import contracts (pyproject ``[tool.importlinter]``) can see that it stays off the build path.

May import: ``orchestra.familycache`` (calibrating through its mapping store), ``orchestra.models``,
``orchestra.documents`` and below; runs and the server read only its manifest.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__all__ = [
    "MEMBERS",
    "MemberSpec",
    "build_family",
    "init_family",
    "home_for_models",
    "load_family",
    "family_dir",
    "FamilyManifest",
    "MemberRecord",
    "Divergence",
]

_LAZY = {
    "MEMBERS": "orchestra.family.build",
    "MemberSpec": "orchestra.family.build",
    "build_family": "orchestra.family.build",
    "init_family": "orchestra.family.init",
    "home_for_models": "orchestra.family.init",
    "load_family": "orchestra.family.manifest",
    "family_dir": "orchestra.family.manifest",
    "FamilyManifest": "orchestra.family.manifest",
    "MemberRecord": "orchestra.family.manifest",
    "Divergence": "orchestra.family.manifest",
}

if TYPE_CHECKING:  # for type checkers, IDEs and the import contracts (which count these imports)
    from orchestra.family.build import MEMBERS, MemberSpec, build_family
    from orchestra.family.init import home_for_models, init_family
    from orchestra.family.manifest import Divergence, FamilyManifest, MemberRecord, family_dir, load_family


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'orchestra.family' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
