"""What a FamilyCache hands out: a lease on a cache of exactly the asked tokens, and the route that made it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, cast

from orchestra.familycache._events import CacheStep

if TYPE_CHECKING:
    from mappings.types import JSONDict, KVCache
    from orchestra.familycache._handles import CacheRef
    from orchestra.familycache.gates import GateDecision

__all__ = ["CacheLease", "CachePath", "StepSink"]

CachePath = Literal["exact", "mapped", "reprefilled"]
StepSink = Callable[[CacheStep], None]


@dataclass
class CacheLease:
    """A cache of exactly `tokens` positions on `member`, held until released; read it, never modify it.

    Agents copy it before extending it. While the lease is held its entry cannot be evicted.
    """

    member: str
    tokens: int
    cache: CacheRef
    path: CachePath
    """exact: the member's own K/V; mapped: carried from `source` through a mapping; reprefilled:
    a mapped cache was refused (`fallback_reason`) and the member computed it itself."""
    reused_tokens: int
    """Positions not computed for this request (taken from a cached prefix or an identical build)."""
    computed_tokens: int
    """Positions computed exactly on the member for this request."""
    source: str | None = None
    """The member whose cache was mapped (mapped, and reprefilled after a refused map)."""
    mapping: str | None = None
    """Folder of the mapping used."""
    gates: list[GateDecision] = field(default_factory=list)
    fallback_reason: str | None = None
    repair: JSONDict | None = None
    """The repair plan applied to the mapped cache: tokens, tail, blocks, planned cost, seconds."""
    seconds: float = 0.0
    """Wall seconds this request took to obtain the cache (including waiting for locks)."""
    prefill_seconds: float = 0.0
    """Seconds this request spent computing tokens exactly on the member."""
    map_seconds: float = 0.0
    """Seconds this request spent mapping, repairing and recomputing the tail."""
    hit: bool = False
    """True when nothing was computed or mapped for this request."""
    tail_tokens: int = 0
    """Trailing positions recomputed on the target after a map."""
    entry_id: int = 0
    """Identity of the cached entry behind this lease (two leases on one entry share the tensors)."""
    load_seconds: float = 0.0
    """Seconds this request spent reading a cache from the disk tier."""
    loaded_tokens: int = 0
    """Positions of this lease read from the disk tier (0: none came from disk)."""
    saved_seconds: float = 0.0
    """What building the disk entry it read had cost (the compute that reading it saved)."""
    steps: list[CacheStep] = field(default_factory=list)
    _release: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Unpin the entry (idempotent); the lease's cache stays usable by whoever still holds it."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def close(self) -> None:
        """Release the pin and let go of the cache: for a holder done with it that may itself live on (a finished
        request's record). Once released, an entry may be evicted; its tensors are freed only when nothing
        refers to them, and the budget no longer counts them, so a lingering lease must not keep them."""
        self.release()
        self.cache = cast("CacheRef", None)

    def __enter__(self) -> CacheLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> CacheLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def gate_dicts(self) -> list[dict[str, object]]:
        return [d.as_dict() for d in self.gates]

    def local_cache(self) -> KVCache:
        """The cache itself, for code that runs it in this process (an in-process executor's lease holds the
        cache; a Ray lease holds a handle to one in an actor, which is decoded there)."""
        if type(self.cache).__name__ == "RemoteKV":
            raise TypeError("this lease's cache lives in a Ray actor: run the op there (executor.run/stream)")
        return cast("KVCache", self.cache)
