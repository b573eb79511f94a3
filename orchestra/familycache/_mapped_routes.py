"""Mapped routes: a member served another member's cache through a mapping, only when its gates pass.

`MappedRoutes.carry_out` takes a route that maps (or reuses or extends an earlier map) and answers a gated
lease or why it was refused: it loads the pair's mapping (kept per pair of fingerprints; a missing, stale or
broken one refuses), decides the offline gate before any work, builds the map through `MappedPath` as a
single-flight build, then reads the probe and, sampled, the shadow gate (a real re-prefill compared) with its
per-pair circuit breaker. A refusal leaves the request to the member's own exact route. Mapped entries live in
their own namespaces (source fingerprint, mapping id and version, variant), so they never pass for exact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from orchestra.familycache._events import CacheStep, MapDetail
from orchestra.familycache._mapped import MapJob, MappedPath, MappedPrefix
from orchestra.familycache._parts import CacheCore
from orchestra.familycache._pool import Entry, Namespace
from orchestra.familycache._records import MappedFrom
from orchestra.familycache._request import CacheRequest, Flight, MappingFailed, mapped_of, variant_of, why
from orchestra.familycache._requests import MappingRequest, TailLogitsRequest
from orchestra.familycache._route import Exact, Extend, Map
from orchestra.familycache.gates import GateDecision, decide_offline

if TYPE_CHECKING:
    from orchestra.familycache._handles import CacheRef, HiddenRef, MappingRef
    from orchestra.familycache._lease import CacheLease, CachePath
    from orchestra.familycache._ops import Computed
    from orchestra.models.registry import ModelInfo

__all__ = ["MappedRoutes"]


class _Cache(CacheCore, Protocol):
    """What the mapped routes read of the FamilyCache they serve, besides its core."""

    warnings: list[str]

    def _dtype(self, info: ModelInfo) -> str: ...

    def _costs_dir(self) -> str | None: ...

    def _compute(self, req: CacheRequest, ids: Sequence[int], base: CacheRef | None, start: int, keep: int,
                 base_hidden: HiddenRef | None = None, want_hidden: bool = False,
                 over: str | None = None) -> Computed: ...

    def _hit(self, req: CacheRequest, entry: Entry, path: CachePath,
             gates: list[GateDecision] | None = None) -> CacheLease: ...

    def _lease(self, req: CacheRequest, entry: Entry, path: CachePath, *, reused: int, fallback: str | None = None,
               source: str | None = None, gates: list[GateDecision] | None = None) -> CacheLease: ...


class MappedRoutes:
    """The mapped routes of one FamilyCache, with the mappings it has loaded."""

    def __init__(self, cache: _Cache) -> None:
        self.cache = cache
        self.loaded: dict[tuple[str, str], MappingRef] = {}
        """(source fingerprint, target fingerprint) -> the mapping loaded for the pair."""

    def path(self) -> MappedPath:
        """The mapped path over the cache's executor, store and policy."""
        return MappedPath(self.cache.executor, self.cache.mappings, self.cache.policy, self.cache._costs_dir())

    def mapping(self, source: str, target: str, cancel: threading.Event | None = None) -> MappingRef:
        s, t = self.cache.executor.info(source), self.cache.executor.info(target)
        key = (s.fingerprint, t.fingerprint)
        if key not in self.loaded:
            try:
                loaded = self.cache.executor.load_mapping(MappingRequest(source, target, self.cache.mappings, cancel))
                mapping, calibrated = loaded.mapping, loaded.calibrated
            except Exception as exc:  # a missing, stale, corrupt or refused mapping is a gate failure
                if cancel is not None and cancel.is_set():
                    raise  # the request was cancelled: stop, do not fall back
                raise MappingFailed(f"no usable mapping {s.name} -> {t.name}: {why(exc)}") from exc
            if calibrated:
                self.cache.warnings.append(f"no mapping for {s.name} -> {t.name}: calibrated one on demand "
                                     f"(do this offline with `orchestra family calibrate`)")
            self.loaded[key] = mapping
        return self.loaded[key]

    def stored_mapping(self, source: str, req: CacheRequest) -> MappingRef | None:
        """The mapping source -> member when one is stored (a disk entry never makes one calibrate on demand)."""
        s, t = self.cache.executor.info(source), req.info
        if (s.fingerprint, t.fingerprint) not in self.loaded and not self.cache.mappings.has(s, t):
            return None
        try:
            return self.mapping(source, req.member, req.cancel)
        except MappingFailed:
            return None

    def carry_out(self, req: CacheRequest, route: Map | Extend | Exact,
                          flight: Flight | None) -> tuple[CacheLease | None, str | None]:
        """A gated mapped lease, or (None, why it was refused); a refused route's flight is landed empty."""
        if isinstance(route, Map):
            source = route.source
        else:
            source = mapped_of(route.entry if isinstance(route, Exact) else route.base).source
        pair = (self.cache.executor.info(source).fingerprint, req.info.fingerprint)
        try:
            if self.cache.breaker.is_open(pair):
                return None, "circuit breaker open for this pair after shadow failures"
            try:
                mapping = self.mapping(source, req.member, req.cancel)
                offline = self.offline(req, mapping)
                if offline is not None and not offline.passed:  # no map, repair or probe changes the manifest
                    req.decisions.append(offline)
                    self._record(req, [offline], source)
                    return None, f"offline gate failed: {offline.reason}"
                if isinstance(route, Exact):
                    entry = route.entry
                elif isinstance(route, Extend):
                    assert flight is not None
                    entry = self.cache.builds.run(req, flight, self._extend_mapped(req, route.base, route.start),
                                             computed=len(req.ids) - route.start)
                else:
                    assert flight is not None
                    entry = self.cache.builds.run(req, flight, self._map_build(req, source, route.source_entry,
                                                                          route.length, mapping))
            except MappingFailed as exc:
                req.decisions.append(GateDecision(False, "mapping", str(exc)))
                req.step(CacheStep(step="gate", member=req.member, passed=False, reason=f"mapping: {exc}",
                                   source=source))
                return None, f"mapping gate failed: {exc}"
        finally:
            if flight is not None and not flight.done.is_set():
                self.cache.builds.land(flight)  # refused before building: its waiters plan again
        decisions = self._gates(req, entry, pair, offline)
        req.decisions.extend(decisions)
        failed = [d for d in decisions if not d.passed]
        if failed:
            repair = mapped_of(entry).repair
            note = repair.ladder.refusal_note() if repair is not None and repair.ladder is not None else ""
            return None, f"{failed[0].gate} gate failed: {failed[0].reason}" + note
        if isinstance(route, Exact):
            return self.cache._hit(req, entry, "mapped", gates=decisions), None
        reused = route.start if isinstance(route, Extend) else mapped_of(entry).carried_tokens
        return self.cache._lease(req, entry, "mapped", reused=reused, gates=decisions), None

    def _mapped_ns(self, req: CacheRequest, source: str, mapping: MappingRef) -> Namespace:
        s = self.cache.executor.info(source)
        return Namespace("mapped", req.info.fingerprint, self.cache._dtype(req.info), req.info.rope,
                         source_fingerprint=s.fingerprint, mapping_id=mapping.manifest.tensors.sha256,
                         mapping_version=mapping.manifest.mapping_version, variant=variant_of(req))

    def _map_build(self, req: CacheRequest, source: str, src_entry: Entry, length: int,
                   mapping: MappingRef) -> Callable[[], Entry]:
        """How to map `source`'s first `length` tokens into the member, repair them and compute the rest."""
        ns = self._mapped_ns(req, source, mapping)
        prefix = req.ids[:length]

        def build() -> Entry:
            tail = max(2, min(req.tail, length - 1))
            kept = src_entry.tail_logits
            src_logits = kept[-tail:] if kept is not None and src_entry.logits_end == length \
                and kept.shape[0] >= tail else \
                self.cache.executor.tail_logits(TailLogitsRequest(source, src_entry.cache, prefix, length, tail)).logits
            job = MapJob(req.member, source, prefix, self.cache.executor.truncate(source, src_entry.cache, length), tail,
                         req.repair, req.gate.probe, src_logits, src_entry.hidden)
            try:
                mapped = self.path().map(job, mapping)
            except Exception as exc:  # any failure to map (bad tensors, I/O, shapes) is a gate failure
                raise MappingFailed(f"mapping {source} -> {req.member} failed: {why(exc)}") from exc
            self.cache.warnings.extend(mapped.warnings)
            return self._mapped_entry(req, ns, job, mapping, mapped)

        return build

    def _mapped_entry(self, req: CacheRequest, ns: Namespace, job: MapJob, mapping: MappingRef,
                      mapped: MappedPrefix) -> Entry:
        """The entry of a map that was made: its steps reported, the request's rest computed exactly after it."""
        length, seconds = len(job.prefix), mapped.computed.seconds
        req.map_s += seconds
        req.step(CacheStep(step="map", member=req.member, source=job.source, tokens=length, seconds=seconds,
                           detail=MapDetail(mapping=str(getattr(mapping, "path", "") or ""), tail=mapped.tail,
                                            exact_sinks=mapped.sinks)))
        if mapped.repair is not None:
            req.step(CacheStep(step="repair", member=req.member, source=job.source, tokens=mapped.repair.tokens,
                               seconds=mapped.repair.total_seconds, detail=mapped.repair))
        cache, logits = mapped.computed.cache, mapped.computed.logits
        if len(req.ids) > length:
            cache = self.cache._compute(req, req.ids, cache, length, 0, over="mapped").cache
        made = MappedFrom(source=job.source, source_fingerprint=self.cache.executor.info(job.source).fingerprint,
                          mapping_id=mapping.manifest.tensors.sha256,
                          mapping_path=str(mapping.path) if getattr(mapping, "path", None) else None,
                          mapped_tokens=length, tail=mapped.tail, exact_sinks=mapped.sinks, probe=mapped.probe,
                          repair=mapped.repair, seconds=seconds)
        return Entry(ns, req.member, req.ids, cache, self.cache.executor.nbytes(cache, logits), tail_logits=logits,
                     logits_end=length, mapped=made, seconds=seconds)

    def _extend_mapped(self, req: CacheRequest, base: Entry, length: int) -> Callable[[], Entry]:
        """How to extend an earlier map of a prefix on this member exactly with the remaining tokens."""

        def build() -> Entry:
            more = self.cache._compute(req, req.ids, base.cache, length, 0, over="mapped")
            made = mapped_of(base)
            made = replace(made, mapped_tokens=min(length, made.mapped_tokens))
            tail_logits = base.tail_logits if base.logits_end <= length else None
            return Entry(base.namespace, req.member, req.ids, more.cache, self.cache.executor.nbytes(more.cache, tail_logits),
                         tail_logits=tail_logits, logits_end=base.logits_end if tail_logits is not None else 0,
                         mapped=made, seconds=more.seconds)

        return build

    def offline(self, req: CacheRequest, mapping: MappingRef) -> GateDecision | None:
        """The offline gate's decision on `mapping` (None when the gate is off).

        It is decided before the map: the manifest's held-out metrics are all it reads, so a mapping it
        refuses would only cost a map (seconds at long context) and a probe before the same fallback.
        """
        if req.gate.offline is None:
            return None
        heldout = mapping.manifest.heldout
        return decide_offline(req.gate.offline, heldout.get("kl"), heldout.get("top1"))

    def _record(self, req: CacheRequest, decisions: list[GateDecision], source: str | None) -> None:
        """One `gate` (or `shadow`) step per decision."""
        for d in decisions:
            req.step(CacheStep(step="shadow" if d.gate == "shadow" else "gate", member=req.member, passed=d.passed,
                               reason=f"{d.gate}: {d.reason}", metrics=d.metrics, source=source))

    def _gates(self, req: CacheRequest, entry: Entry, pair: tuple[str, str],
               offline: GateDecision | None) -> list[GateDecision]:
        """The gates on a mapped `entry`: the offline decision taken before the map (it passed), then the rest."""
        policy = req.gate
        decisions: list[GateDecision] = [offline] if offline is not None else []
        made = mapped_of(entry)
        if policy.probe is not None:
            if made.probe is None:
                decisions.append(GateDecision(False, "probe", "no probe measurement (the prefix is shorter than the probe)"))
            else:
                decisions.append(made.probe.decide(policy.probe))
        if policy.shadow is not None and entry.tail_logits is not None and self.cache.breaker.should_shadow(policy.shadow):
            decisions.append(self._shadow(req, entry, pair))
        self._record(req, decisions, made.source)
        return decisions

    def _shadow(self, req: CacheRequest, entry: Entry, pair: tuple[str, str]) -> GateDecision:
        """Re-prefill the member on the mapped prefix and compare next-token distributions over the probe tail."""
        from mappings.metrics import mean_kl

        policy = req.gate.shadow
        assert policy is not None
        assert entry.tail_logits is not None  # the caller shadows only entries that kept their tail logits
        mapped_logits = entry.tail_logits
        end, tail = entry.logits_end, int(mapped_logits.shape[0])
        prefix = req.ids[:end]
        ns = self.cache._exact_ns(req.info)
        base, base_len = self.cache.pool.longest_prefix(ns, prefix, pin=True)
        if base is not None:
            req.pinned.append(base)
        exact, _ = self.cache.builds.single_flight(req, ns, prefix,
                                       self.cache._exact_build(req, ns, base, base_len if base_len < end else 0, ids=prefix))
        if exact.tail_logits is not None and exact.logits_end == end and exact.tail_logits.shape[0] >= tail:
            reference = exact.tail_logits[-tail:]
        else:
            reference = self.cache.executor.tail_logits(TailLogitsRequest(req.member, exact.cache, prefix, end, tail)).logits
        kl = mean_kl(reference, mapped_logits)
        passed = kl <= policy.max_kl
        opened = self.cache.breaker.record(pair, passed, policy)
        return GateDecision(passed, "shadow", f"shadow KL {kl:.4f} {'<=' if passed else '>'} {policy.max_kl}"
                            + ("; breaker opened" if opened else ""), {"shadow_kl": kl, **self.cache.breaker.stats(pair)})
