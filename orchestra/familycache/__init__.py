"""FamilyCache: the one component that turns (family member, token ids) into a usable KV cache.

    cache = FamilyCache.for_family(load_family(), source="root")   # orchestra.family.load_family
    with cache.acquire_sync("finetuned", ids) as lease:   # exact, mapped from root, or re-prefilled
        print(lease.path, lease.reused_tokens, lease.gate_dicts())

The pipeline scheduler, the chat example, evaluate and the benchmarks all stand on it; nothing
else in orchestra maps, repairs, gates or falls back.

Owns the pool and its leases, routing, single-flight builds, the mapped path with its gates
(`gates.py`), repair and fallback, the mapping store (`mapping_store.py`), the disk tier, the
executor seam (local and Ray) and the scoring of what an agent gets (`served.py`).

May import: ``orchestra.models``, ``orchestra.documents``, ``orchestra.errors``, ``orchestra.paths``,
``agents`` and ``mappings``; never ``orchestra.family``, pipelines, runs or the server: a family's
members and the executor settings are given by the caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestra._exports import lazy_exports

if TYPE_CHECKING:
    from orchestra.familycache._core import CacheLease, CachePath, FamilyCache, StepSink
    from orchestra.familycache._disk import DiskStats, KVStore, LoadedEntry, StoredEntry
    from orchestra.familycache._events import CacheStep, StepKind
    from orchestra.familycache._executor import Executor, LocalExecutor
    from orchestra.familycache._factory import EXECUTORS, UnknownExecutorError, executor_class, make_executor
    from orchestra.familycache._policy import CachePolicy
    from orchestra.familycache._pool import Entry, EntryPool, Namespace, PoolStats, token_hash
    from orchestra.familycache._requests import (
        ComputeRequest,
        Importance,
        ImportanceRequest,
        MappingRequest,
        MappingResult,
        MapRequest,
        MapResult,
        PassCostsRequest,
        ProbeReferenceRequest,
        TailLogitsRequest,
    )
    from orchestra.familycache._settings import ExecutorSpec, MemberResources

__all__ = [
    "FamilyCache",
    "CacheLease",
    "CachePath",
    "CachePolicy",
    "CacheStep",
    "StepKind",
    "StepSink",
    "Executor",
    "ExecutorSpec",
    "MemberResources",
    "LocalExecutor",
    # the executor seam's typed requests and results
    "ComputeRequest",
    "TailLogitsRequest",
    "MapRequest",
    "MapResult",
    "MappingRequest",
    "MappingResult",
    "ProbeReferenceRequest",
    "ImportanceRequest",
    "Importance",
    "PassCostsRequest",
    "make_executor",
    "executor_class",
    "EXECUTORS",
    "UnknownExecutorError",
    "EntryPool",
    "Entry",
    "Namespace",
    "PoolStats",
    "token_hash",
    "KVStore",
    "StoredEntry",
    "LoadedEntry",
    "DiskStats",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "orchestra.familycache._core": (
            "CacheLease",
            "CachePath",
            "FamilyCache",
            "StepSink",
        ),
        "orchestra.familycache._disk": (
            "DiskStats",
            "KVStore",
            "LoadedEntry",
            "StoredEntry",
        ),
        "orchestra.familycache._events": (
            "CacheStep",
            "StepKind",
        ),
        "orchestra.familycache._executor": (
            "Executor",
            "LocalExecutor",
        ),
        "orchestra.familycache._factory": (
            "EXECUTORS",
            "UnknownExecutorError",
            "executor_class",
            "make_executor",
        ),
        "orchestra.familycache._policy": ("CachePolicy",),
        "orchestra.familycache._pool": (
            "Entry",
            "EntryPool",
            "Namespace",
            "PoolStats",
            "token_hash",
        ),
        "orchestra.familycache._requests": (
            "ComputeRequest",
            "Importance",
            "ImportanceRequest",
            "MappingRequest",
            "MappingResult",
            "MapRequest",
            "MapResult",
            "PassCostsRequest",
            "ProbeReferenceRequest",
            "TailLogitsRequest",
        ),
        "orchestra.familycache._settings": (
            "ExecutorSpec",
            "MemberResources",
        ),
    },
)
