"""The family's stored root -> member mapping with both models loaded, as the served-map benchmarks score it.

The mapping folder is the one `MappingStore.path_for` names for the pair (the one `orchestra family
calibrate` wrote), so a benchmark scores exactly what a FamilyCache would load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mappings.models import ModelHandle
    from mappings.store import Mapping

__all__ = ["StoredPair", "load_stored_pair"]


@dataclass(frozen=True)
class StoredPair:
    """The root and `role`'s member: their folders and loaded models, and the stored mapping between them."""

    name: str  # the member's name in the family
    source_path: Path
    target_path: Path
    source: ModelHandle
    target: ModelHandle
    folder: Path
    mapping: Mapping


def load_stored_pair(role: str, home: str | None) -> StoredPair:
    from mappings.models import load_model
    from mappings.store import load_mapping
    from orchestra.family import load_family
    from orchestra.familycache.mapping_store import MappingStore
    from orchestra.models.registry import ModelRegistry

    family = load_family(home)
    registry = ModelRegistry({"root": "root", role: role}, family=family, default_device="cpu")
    root, member = registry.info("root"), registry.info(role)
    folder = MappingStore(Path(family.home) / "mappings").path_for(root, member)
    src, tgt = load_model(root.path), load_model(member.path)
    return StoredPair(member.name, root.path, member.path, src, tgt, folder,
                      load_mapping(folder, src.fingerprint, tgt.fingerprint))
