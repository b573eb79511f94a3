"""The bundled model family: SmolLM2-135M-Instruct and members derived from it by project code."""

from __future__ import annotations

from orchestra.family.build import MEMBERS, MemberSpec, build_family, family_dir, load_family
from orchestra.family.manifest import Divergence, FamilyManifest, MemberRecord

__all__ = [
    "MEMBERS",
    "MemberSpec",
    "build_family",
    "load_family",
    "family_dir",
    "FamilyManifest",
    "MemberRecord",
    "Divergence",
]
