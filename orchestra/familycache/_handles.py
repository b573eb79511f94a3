"""The values that cross the executor seam, by name: caches, hidden states and mappings as an executor hands
them out (the objects themselves in process, handles on Ray's object store for `RayExecutor`).

They live apart from `_executor.py` (the contract) and `_ray.py` (one executor) so that both, and `_ops.py`,
can name them without importing each other; nothing here imports ray or torch at run time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, TypeAlias

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from ray import ObjectRef

    from agents.runner import TokenEvent
    from mappings.manifest import MappingManifest
    from mappings.store import Mapping as LoadedMapping
    from mappings.types import KVCache, Tensor
    from orchestra.familycache.mapping_store import MappingStoreConfig
    from orchestra.models.registry import ModelInfo

__all__ = ["CacheRef", "HiddenRef", "MappingRef", "OnToken", "RemoteKV", "RemoteHidden", "RemoteMapping"]

WireArray: TypeAlias = "npt.NDArray[np.generic]"
"""A tensor's bytes as numpy (bfloat16 carried as int16 bits): what travels through the object store."""

PackedHidden: TypeAlias = "dict[int, tuple[WireArray, str]]"
"""Hidden states as they travel: layer index -> (array, torch dtype name)."""


@dataclass
class PackedCache:
    """One cache as it travels: per-layer (K, V) as numpy arrays (zero-copy out of the object store)."""

    layers: list[tuple[WireArray, WireArray]]
    dtype: str
    length: int



# -- handles the driver holds ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RemoteKV:
    """A K/V cache in Ray's object store: the first `length` positions of one cache an actor built."""

    ref: ObjectRef[list[PackedCache]]
    """ObjectRef of the list of packed caches the op returned (this one is at `index`)."""
    index: int
    length: int
    total: int
    """Positions the stored cache holds (a view covers the first `length`)."""
    position_bytes: int
    """Bytes of K/V per position, over all layers."""
    layers: int
    producer: str
    """The actor that built it."""
    node: str
    """The node it was built on (where its bytes live)."""

    @property
    def nbytes(self) -> int:
        return self.position_bytes * self.length

    def view(self, length: int) -> RemoteKV:
        """The first `length` positions: the same object, nothing copied."""
        if not 0 < length <= self.total:
            raise ValueError(f"cannot view {length} positions of a cache of {self.total}")
        return replace(self, length=length)


@dataclass(frozen=True)
class RemoteHidden:
    """Hidden states entering each layer (kept for layer repair) in Ray's object store."""

    ref: ObjectRef[list[PackedHidden]]
    index: int
    nbytes: int
    producer: str
    node: str


@dataclass(frozen=True)
class RemoteMapping:
    """The driver's proxy of a mapping loaded in a target's actor: what gates read, never the tensors."""

    key: tuple[str, str]
    path: str | None
    manifest: MappingManifest
    residual: Literal[True] | None
    """True when the mapping has residual maps (layer repair), else None (as `mapping.residual` reads)."""
    store: MappingStoreConfig = field(repr=False)
    """How the actor finds it again (after a restart, or on another replica)."""
    source: ModelInfo = field(repr=False)
    """The source's ModelInfo (the actor looks the mapping up by its fingerprint)."""



CacheRef: TypeAlias = "KVCache | RemoteKV"
"""A cache as an executor hands it out and takes it back: the cache itself in process, a handle on the stored
object for a remote executor (`_ray.RemoteKV`). Callers never look inside; they pass it back."""

HiddenRef: TypeAlias = "dict[int, Tensor] | RemoteHidden"
"""Hidden states entering each layer (by layer index) kept beside a cache: the tensors, or a remote handle."""

MappingRef: TypeAlias = "LoadedMapping | RemoteMapping"
"""A loaded mapping: the `mappings.store.Mapping` in process, or the ray executor's proxy of one in an actor."""

OnToken: TypeAlias = "Callable[[TokenEvent], Awaitable[None] | None]"
"""A per-token callback of an agent's generation, sync or async."""
