"""The family side of the connector: what the store holds for a prompt, and mapped caches built by FamilyCache.

It runs in vLLM's scheduler process. Finding what the store holds reads file names and headers only, so it
is answered inside the scheduler's step. A mapped cache is built by orchestra's own `FamilyCache` (the same
route, gates, exact sinks, repair and recomputed tail as every other orchestra run) on the family's models,
loaded here with transformers the first time a map is needed, and handed to the worker as a file; the map
itself runs in a background thread while vLLM is told to ask again.
"""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestra.errors import OrchestraError

if TYPE_CHECKING:
    from mappings.types import Tensor
    from orchestra.familycache import FamilyCache, KVStore, Namespace, StoredEntry
    from orchestra.vllm._settings import ConnectorSettings

__all__ = ["FamilyLookup", "StoredHit", "MappedBuild", "ConnectorSetupError"]


class ConnectorSetupError(OrchestraError):
    """The connector's settings do not fit the engine (another model, an unknown member, no family)."""


@dataclass(frozen=True)
class StoredHit:
    """The member's own exact entry holding the prompt's first `length` tokens."""

    entry: StoredEntry
    length: int


@dataclass(frozen=True)
class MappedBuild:
    """What FamilyCache made of a prompt's prefix: a cache to load (mapped, or the member's own) or a refusal."""

    length: int
    kind: str
    """``mapped``, or ``refused`` (nothing to load: the engine computes the prefix itself)."""
    handoff: str | None = None
    source: str | None = None
    mapping: str | None = None
    gates: tuple[str, ...] = ()
    reason: str | None = None


class FamilyLookup:
    """One member's view of the family's store and mappings, for the scheduler side of the connector."""

    def __init__(self, settings: ConnectorSettings, *, dtype: str, model_path: str) -> None:
        from orchestra.family.manifest import load_family
        from orchestra.familycache import KVStore

        self.settings = settings
        try:
            self.family = load_family(settings.home)
        except OrchestraError as exc:
            raise ConnectorSetupError(f"the connector's family home {settings.home!r} holds no family: {exc}") from exc
        self.member = self._member_name(settings.member)
        self._check_model(model_path)
        self.dtype = dtype
        self.store: KVStore = KVStore(settings.store_dir, settings.store_mb << 20, min_tokens=settings.min_tokens,
                                      min_new_tokens=settings.min_tokens)
        self._cache: FamilyCache | None = None
        self._cache_lock = threading.Lock()
        self._jobs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchestra-vllm-map")
        self.namespace = self.cache.exact_namespace(self.member)
        if settings.warm and self.cache.source != self.member:
            # the models a map needs load now, beside vLLM's start-up, not in the first mapped request
            self._jobs.submit(self._warm)

    def _warm(self) -> None:
        cache = self.cache
        if cache.mappings.has(cache.executor.info(cache.source), cache.executor.info(self.member)):
            cache.executor.model(cache.source)
            cache.executor.model(self.member)

    def _member_name(self, key: str) -> str:
        for name, record in self.family.members.items():
            if key in (name, record.role):
                return name
        known = ", ".join(f"{n} ({r.role})" for n, r in self.family.members.items())
        raise ConnectorSetupError(f"the connector's member {key!r} is not in the family at {self.settings.home}: "
                                  f"name one of {known}")

    def _check_model(self, model_path: str) -> None:
        member_path = Path(self.family.member(self.member).path).resolve()
        served = Path(model_path).expanduser()
        if served.exists() and served.resolve() != member_path:
            raise ConnectorSetupError(f"vLLM serves {served} but the connector's member {self.member!r} is "
                                      f"{member_path}: start vLLM on that folder, or name the member it serves")

    @property
    def cache(self) -> FamilyCache:
        """The family's FamilyCache over the shared store (models load on the first map, not before)."""
        with self._cache_lock:
            if self._cache is None:
                from orchestra.familycache import CachePolicy, FamilyCache

                policy = CachePolicy(tail_tokens=self.settings.tail_tokens,
                                     min_mapped_tokens=self.settings.min_mapped_tokens)
                source = next((n for n, r in self.family.members.items() if r.role == "root"), self.member)
                self._cache = FamilyCache.for_family(
                    self.family, source=source, members={n: n for n in self.family.members}, device="cpu",
                    dtype=self.dtype, mapping_dir=self.settings.mapping_dir, policy=policy, disk=self.store)
            return self._cache

    # -- what the store holds ---------------------------------------------------------------------------------
    def own_entry(self, ids: tuple[int, ...]) -> StoredHit | None:
        """The member's longest stored exact prefix of `ids`."""
        entry, length = self.store.find(self.namespace, ids)
        return StoredHit(entry, length) if entry is not None else None

    def mappable_length(self, ids: tuple[int, ...]) -> int:
        """The longest prefix of `ids` another member (or a map into this one) holds in the store."""
        from orchestra.familycache._pool import common_prefix

        best = 0
        for entry in self.store.entries():
            ns = entry.namespace
            if ns == self.namespace or not self._may_map(ns):
                continue
            best = max(best, common_prefix(entry.tokens, ids))
        return best

    def _may_map(self, ns: Namespace) -> bool:
        if ns.kind == "mapped":  # a map into this member, of this dtype
            return ns.member_fingerprint == self.namespace.member_fingerprint and ns.dtype == self.namespace.dtype
        return ns.dtype == self.namespace.dtype and ns.member_fingerprint in self._source_fingerprints()

    def _source_fingerprints(self) -> set[str]:
        cache = self.cache
        return {cache.executor.info(cache.source).fingerprint} if cache.source != self.member else set()

    # -- mapped builds ----------------------------------------------------------------------------------------
    def submit(self, ids: tuple[int, ...]) -> Future[MappedBuild]:
        """Build the member's cache of `ids` through FamilyCache in the background."""
        return self._jobs.submit(self._build, ids)

    def _build(self, ids: tuple[int, ...]) -> MappedBuild:
        """A mapped cache of `ids`, or a refusal: never a prefill (the engine computes what is not mapped)."""
        cache = self.cache
        source, target = cache.executor.info(cache.source), cache.executor.info(self.member)
        if not cache.mappings.has(source, target):
            return MappedBuild(0, "refused", reason=f"no mapping {cache.source} -> {self.member} in "
                                                    f"{cache.mappings.directory}: run `orchestra family calibrate`")
        try:
            lease = cache.acquire_sync(self.member, ids)
        except Exception as exc:  # a damaged mapping, a model that will not load: the engine computes
            return MappedBuild(0, "refused", reason=f"{type(exc).__name__}: {exc}")
        with lease:
            gates = tuple(f"{g.gate}={'pass' if g.passed else 'fail'}" for g in lease.gates)
            if lease.path != "mapped":  # a refused gate (FamilyCache re-prefilled), or the member's own entry
                return MappedBuild(0, "refused", gates=gates, reason=lease.fallback_reason or f"path {lease.path}")
            handoff = self._write_handoff(cache.executor.export_cache(self.member, lease.cache), len(ids))
        return MappedBuild(len(ids), "mapped", handoff, lease.source, lease.mapping, gates)

    def _write_handoff(self, layers: list[tuple[Tensor, Tensor]], length: int) -> str:
        from safetensors.torch import save

        from mappings.atomic import write_atomic

        tensors = {}
        for i, (k, v) in enumerate(layers):
            tensors[f"k.{i}"] = k[..., :length, :].contiguous()
            tensors[f"v.{i}"] = v[..., :length, :].contiguous()
        folder = self.settings.handoff_dir
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{os.getpid()}-{uuid.uuid4().hex}.safetensors"
        write_atomic(path, save(tensors))
        return str(path)

    def close(self) -> None:
        self._jobs.shutdown(wait=True, cancel_futures=True)
        self.store.close()
