"""What every part of a FamilyCache reads of the cache it belongs to (the parts state the rest themselves)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from orchestra.familycache._executor import Executor
    from orchestra.familycache._flights import Builds
    from orchestra.familycache._policy import CachePolicy
    from orchestra.familycache._pool import Entry, EntryPool, Namespace
    from orchestra.familycache._request import CacheRequest
    from orchestra.familycache.gates import CircuitBreaker
    from orchestra.familycache.mapping_store import MappingStore
    from orchestra.models.registry import ModelInfo

__all__ = ["CacheCore"]


class CacheCore(Protocol):
    """The pool, the executor, the policy, the mappings, the breaker and the builds of a FamilyCache, and how it
    names and builds a member's exact cache."""

    pool: EntryPool
    executor: Executor
    policy: CachePolicy
    mappings: MappingStore
    breaker: CircuitBreaker
    builds: Builds

    def _exact_ns(self, info: ModelInfo) -> Namespace: ...

    def _exact_build(self, req: CacheRequest, ns: Namespace, base: Entry | None, base_len: int,
                     ids: tuple[int, ...] | None = None) -> Callable[[], Entry]: ...
