"""FamilyCache: the one component that turns (family member, token ids) into a usable KV cache.

    cache = FamilyCache.for_family(load_family(), source="root")   # orchestra.family.load_family
    with cache.acquire_sync("finetuned", ids) as lease:   # exact, mapped from root, or re-prefilled
        print(lease.path, lease.reused_tokens, lease.gate_dicts())

The pipeline scheduler, the chat example, evaluate and the benchmarks all stand on it; nothing
else in orchestra maps, repairs, gates or falls back.
"""

from __future__ import annotations

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
