"""The disk tier seen from FamilyCache: entries read back before anything is computed, built ones written behind.

`DiskTier.promote` reads into memory the stored entry holding the longest prefix of a request beyond what
memory holds (the member's own, a mapped one of a mapping loaded now, or a source's it maps from), so the
planner then routes over memory as always; `write_behind` queues every entry built for the store without
blocking the request. The store itself (files, checksums, budget) is `KVStore` (`_disk.py`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol, cast

from orchestra._logging import get_logger
from orchestra.errors import OrchestraError
from orchestra.familycache._events import CacheStep, EvictDetail, LoadDetail
from orchestra.familycache._pool import Entry
from orchestra.familycache._records import MappedFrom, ProbeReading
from orchestra.familycache._request import CacheRequest, variant_of

if TYPE_CHECKING:
    from mappings.repair import RepairPolicy
    from orchestra.familycache._disk import KVStore, StoredEntry
    from orchestra.familycache._executor import Executor
    from orchestra.familycache._mapped_routes import MappedRoutes
    from orchestra.familycache._planner import Planner
    from orchestra.familycache._pool import EntryPool, Namespace
    from orchestra.models.registry import ModelInfo

__all__ = ["DiskTier"]

log = get_logger("orchestra.cache")


class _Cache(Protocol):
    """What the disk tier reads of the FamilyCache it serves."""

    pool: EntryPool
    executor: Executor
    planner: Planner
    routes: MappedRoutes
    _rates: dict[str, float]

    def _exact_ns(self, info: ModelInfo) -> Namespace: ...

    def _wants_hidden(self, member: str, repair: RepairPolicy | None) -> bool: ...


@dataclass(frozen=True)
class _Candidate:
    """A stored entry holding `length` tokens of a request more than memory does: the member's own (rank 0),
    a mapped one (1), or a source's it maps from (2)."""

    length: int
    rank: int
    space: Namespace
    stored: StoredEntry
    member: str


class DiskTier:
    """A `KVStore` under a FamilyCache: promotion before routing, write-behind after building."""

    def __init__(self, store: KVStore, cache: _Cache) -> None:
        self.store = store
        self.cache = cache
        self._lock = threading.Lock()
        """Concurrent requests for one document read it once."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued writes (True when all landed)."""
        return self.store.flush(timeout)

    def promote(self, req: CacheRequest, mapped_ok: bool) -> None:
        """Read into memory the disk entry holding the longest prefix of the request beyond what memory holds.

        Candidates are the member's own exact entries, its mapped entries of the mappings loaded now (a mapped
        entry of a mapping that changed is deleted, never served), and the exact entries of members it maps
        from; on a tie the member's own cache wins, then a mapped one. The planner then routes over memory
        as always (a mapped entry read from disk is still served as mapped, through its gates).
        """
        try:
            found = self._candidates(req, mapped_ok)
        except OSError as exc:  # an unreadable store is a miss, never a failed request
            log.warning("kv_store_unreadable", error=str(exc))
            return
        if found:
            self._load(req, max(found, key=lambda c: (c.length, -c.rank)))

    def _candidates(self, req: CacheRequest, mapped_ok: bool) -> list[_Candidate]:
        """Stored entries longer than what memory holds of the request, with the member each belongs to."""
        disk = self.store
        found: list[_Candidate] = []

        def consider(space: Namespace, member: str, rank: int) -> None:
            stored, length = disk.find(space, req.ids)
            if stored is not None and length >= disk.min_tokens \
                    and length > self.cache.pool.longest_prefix(space, req.ids)[1]:
                found.append(_Candidate(length, rank, space, stored, member))

        consider(self.cache._exact_ns(req.info), req.member, 0)
        if not mapped_ok or len(req.ids) < 3:
            return found
        sources = self.cache.planner.sources_for(req.member, req.info)
        by_fingerprint = {self.cache.executor.info(m).fingerprint: m for m in sources}
        for space in disk.namespaces_for(req.info.fingerprint):
            source = by_fingerprint.get(space.source_fingerprint or "")
            if space.kind != "mapped" or source is None or space.variant != variant_of(req):
                continue
            mapping = self.cache.routes.stored_mapping(source, req)
            if mapping is None:
                continue
            if (space.mapping_id, space.mapping_version) != (mapping.manifest.tensors.sha256,
                                                              mapping.manifest.mapping_version):
                disk.drop_namespace(space)  # made by a mapping since replaced: never served again
                continue
            consider(space, req.member, 1)
        for source in sources:  # a source cache read for a layer repair would lack its hidden states
            if not self.cache._wants_hidden(source, req.repair):
                consider(self.cache._exact_ns(self.cache.executor.info(source)), source, 2)
        return found

    def _load(self, req: CacheRequest, best: _Candidate) -> None:
        """Read `best` into the pool (pinned for the request) and report the load, unless memory has it by now."""
        length, space, stored, member = best.length, best.space, best.stored, best.member
        with self._lock:  # concurrent requests for one document read it once
            if self.cache.pool.longest_prefix(space, req.ids)[1] >= length:
                return
            t0 = time.perf_counter()
            loaded = self.store.load(stored)
            if loaded is None:
                req.step(CacheStep(step="load", member=req.member, tokens=0, reason="the stored cache was corrupt "
                                   "or gone: deleted, computing instead", detail=LoadDetail()))
                return
            cache = self.cache.executor.import_cache(member, loaded.layers)
            mapped = self._mapped_from_disk(loaded.mapped, member, req) if space.kind == "mapped" else None
            if space.kind == "mapped" and mapped is None:
                return
            entry = Entry(space, member, stored.tokens, cache, self.cache.executor.nbytes(cache, loaded.tail_logits),
                          tail_logits=loaded.tail_logits, logits_end=loaded.logits_end, mapped=mapped,
                          seconds=loaded.seconds, on_disk=True)
            for victim in self.cache.pool.add(entry, pin=True):
                req.step(CacheStep(step="evict", member=victim.member, tokens=len(victim.tokens),
                                   detail=EvictDetail(bytes=victim.nbytes, kind=victim.namespace.kind)))
            req.pinned.append(entry)
            seconds = time.perf_counter() - t0
        if space.kind == "exact" and len(stored.tokens) >= 64 and loaded.seconds > 0:
            self.cache._rates.setdefault(member, loaded.seconds / len(stored.tokens))  # what prefill_estimate saved
        req.load_s += seconds
        req.loaded_tokens = max(req.loaded_tokens, length)
        req.saved_s += loaded.seconds * length / max(1, len(stored.tokens))
        req.step(CacheStep(step="load", member=req.member, tokens=length, reused_tokens=length, seconds=seconds,
                           source=member if member != req.member else None,
                           detail=LoadDetail(kind=space.kind, entry_tokens=len(stored.tokens), bytes=stored.nbytes,
                                             key=stored.key)))
        log.info("cache_loaded", member=req.member, tokens=length, kind=space.kind, seconds=round(seconds, 3))

    def _mapped_from_disk(self, record: dict[str, object] | None, source_of_entry: str,
                          req: CacheRequest) -> MappedFrom | None:
        """A mapped entry's record as read back, naming this process's source member and mapping folder."""
        if not record:
            return None
        try:
            source_fp = str(record["source_fingerprint"])
            source = next(m for m in self.cache.planner.sources_for(req.member, req.info)
                          if self.cache.executor.info(m).fingerprint == source_fp)
            mapping = self.cache.routes.loaded.get((source_fp, req.info.fingerprint))
            probe = record.get("probe")
            repair = record.get("repair")
            from mappings.repair_records import RepairSummary

            return MappedFrom(
                source=source, source_fingerprint=source_fp, mapping_id=str(record["mapping_id"]),
                mapping_path=str(mapping.path) if mapping is not None and getattr(mapping, "path", None) else None,
                mapped_tokens=int(cast("int", record["mapped_tokens"])), tail=int(cast("int", record["tail"])),
                exact_sinks=int(cast("int", record["exact_sinks"])),
                probe=ProbeReading(**cast("dict[str, float]", probe)) if isinstance(probe, dict) else None,
                repair=RepairSummary.model_validate(repair) if repair is not None else None,
                seconds=float(cast("float", record.get("seconds", 0.0))))
        except (KeyError, StopIteration, TypeError, ValueError) as exc:
            log.warning("kv_store_bad_record", error=str(exc))
            return None

    def write_behind(self, entry: Entry) -> None:
        """Queue a built entry for the disk tier (it never blocks the request)."""
        disk = self.store
        if len(entry.tokens) < disk.min_tokens:
            return
        try:
            layers = self.cache.executor.export_cache(entry.member, entry.cache)
        except OrchestraError as exc:
            log.warning("kv_store_export_failed", error=str(exc))
            return
        record = None
        if entry.mapped is not None:
            made = entry.mapped
            record = {"source_fingerprint": made.source_fingerprint, "mapping_id": made.mapping_id,
                      "mapped_tokens": made.mapped_tokens, "tail": made.tail, "exact_sinks": made.exact_sinks,
                      "probe": asdict(made.probe) if made.probe is not None else None,
                      "repair": made.repair.model_dump(mode="json") if made.repair is not None else None,
                      "seconds": made.seconds, "source": made.source}
        entry.on_disk = True
        disk.put(entry.namespace, entry.member, entry.tokens, layers, tail_logits=entry.tail_logits,
                 logits_end=entry.logits_end, seconds=entry.seconds, mapped=record)
