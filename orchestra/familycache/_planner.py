"""Planning a request's route over what the pool holds and what is being built, and waiting where it says to.

`Planner.plan` looks at the pool and the builds in flight and registers the build the route needs, under the
builds' lock, so of concurrent requests over one document exactly one builds it; `plan_and_join` waits for
the builds a route names and builds a seed on the source when the route says so, then plans again, until the
route is one to carry out. The routing decision itself is the pure `plan_route` (`_route.py`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from orchestra.errors import OrchestraError
from orchestra.familycache._events import CacheStep, JoinDetail
from orchestra.familycache._parts import CacheCore
from orchestra.familycache._pool import Entry, common_prefix
from orchestra.familycache._request import CacheRequest, Flight, variant_of
from orchestra.familycache._route import (
    Exact,
    Extend,
    Held,
    InFlight,
    Join,
    Map,
    Route,
    RouteRequest,
    Seed,
    plan_route,
)

if TYPE_CHECKING:

    from orchestra.familycache._mapped_routes import MappedRoutes
    from orchestra.familycache._pool import Namespace
    from orchestra.models.registry import ModelInfo

__all__ = ["Planner"]


class _Cache(CacheCore, Protocol):
    """What the planner reads of the FamilyCache it plans for, besides its core."""

    source: str
    routes: MappedRoutes


class Planner:
    """Plans routes for one FamilyCache."""

    def __init__(self, cache: _Cache) -> None:
        self.cache = cache

    def plan_and_join(self, req: CacheRequest, mapped_ok: bool) -> tuple[Route, Flight | None]:
        """A route that is neither `Join` nor `Seed`: every build it names to wait for is waited for, the
        seed it names is built (once), then the plan is redone."""
        seed_ok = mapped_ok
        while True:
            route, flight = self.plan(req, mapped_ok, seed_ok)
            if isinstance(route, Seed):
                assert flight is not None
                seed_ok = False
                self._seed(req, route, flight)
                continue
            if not isinstance(route, Join):
                return route, flight
            t0 = time.perf_counter()
            waited: Flight = route.flight
            with self.cache.builds.lock:
                self.cache.pool.stats.waiting += 1
            try:
                waited.done.wait()
            finally:
                with self.cache.builds.lock:
                    self.cache.pool.stats.waiting -= 1
            whole = waited.ids == req.ids and waited.member_ns == self.cache._exact_ns(req.info)
            if waited.entry is not None and whole:
                req.joined.add(waited.entry.id)
            req.step(CacheStep(step="join", member=req.member, tokens=route.tokens,
                               reused_tokens=len(req.ids) if whole else 0, seconds=time.perf_counter() - t0,
                               detail=JoinDetail(waited_for="mapped" if route.mapped else "exact",
                                                 prefix_of=route.tokens, on=route.member)))

    def plan(self, req: CacheRequest, mapped_ok: bool, seed_ok: bool = False) -> tuple[Route, Flight | None]:
        """`plan_route` over the pool and the builds in flight, and the build it plans registered, atomically.

        Looking up the builds in flight and registering this request's own happen under one lock, so of
        concurrent requests over one document exactly one builds it and the others wait for it (on this
        member) or for it then map it (on a member with a mapping from the builder's). The entries the
        route reuses are pinned before the lock is let go.
        """
        ns = self.cache._exact_ns(req.info)
        sources = self.sources_for(req.member, req.info) if mapped_ok and len(req.ids) >= 3 else []
        spaces = {self.cache._exact_ns(self.cache.executor.info(m)): m for m in sources}
        variant = variant_of(req)
        seed = self._seed_for(req, sources) if seed_ok else None
        with self.cache.builds.lock, self.cache.pool.held_still():
            if req.inline_tail:
                self._shrink_to_shared(req, {ns} | set(spaces))
            held = self._held(req, ns, sources, variant if mapped_ok else None)
            flights = []
            for f in self.cache.builds.flights:
                if f.member_ns == ns and (f.variant is None or f.variant == variant):
                    flights.append(InFlight(f, req.member, f.ids, f.variant is not None))
                elif f.variant is None and f.member_ns in spaces:
                    flights.append(InFlight(f, spaces[f.member_ns], f.ids))
            route = plan_route(RouteRequest(req.member, req.ids, mapped_ok, self.cache.policy.min_mapped_tokens, seed),
                               held, sources, flights)
            reused = {Exact: "entry", Extend: "base", Map: "source_entry", Seed: "base"}.get(type(route))
            if reused is not None and getattr(route, reused) is not None:
                entry: Entry = getattr(route, reused)
                self.cache.pool.pin(entry)
                req.pinned.append(entry)
            if isinstance(route, (Join, Exact)):
                return route, None
            if isinstance(route, Seed):
                return route, self.cache.builds.register(
                    self.cache._exact_ns(self.cache.executor.info(route.source)), req.ids, None)
            mapped = isinstance(route, Map) or (isinstance(route, Extend) and route.mapped)
            return route, self.cache.builds.register(ns, req.ids, variant if mapped else None)

    def _shrink_to_shared(self, req: CacheRequest, spaces: set[Namespace]) -> None:
        """Cut the request to the longest prefix cached or in flight in `spaces` (or the member's mapped
        namespaces) when at most `inline_tail` tokens are left over; once, with the flight lock held, so of a
        cold burst only the first request builds its whole prompt and the others wait for its shared prefix."""
        limit, req.inline_tail = req.inline_tail, 0
        shared = 0
        for space in spaces | {s for s in self.cache.pool.namespaces_for(req.info.fingerprint) if s.kind == "mapped"}:
            shared = max(shared, self.cache.pool.longest_prefix(space, req.ids)[1])
        for flight in self.cache.builds.flights:
            if flight.member_ns in spaces:
                shared = max(shared, common_prefix(flight.ids, req.ids))
        if 0 < shared < len(req.ids) and len(req.ids) - shared <= limit:
            req.ids = req.ids[:shared]

    def _held(self, req: CacheRequest, ns: Namespace, sources: list[str], variant: str | None) -> list[Held]:
        """What the pool holds for the request: its member's exact prefix, its usable mapped entries (when
        `variant` is given), the exact prefixes of `sources`."""
        out: list[Held] = []
        entry, length = self.cache.pool.longest_prefix(ns, req.ids)
        if entry is not None:
            out.append(Held(entry, req.member, length))
        if variant is None:
            return out
        for space in self.cache.pool.namespaces_for(req.info.fingerprint):
            if space.kind != "mapped" or space.variant != variant:
                continue
            current = self.cache.routes.loaded.get((space.source_fingerprint or "", req.info.fingerprint))
            if current is None or current.manifest.tensors.sha256 != space.mapping_id:
                continue  # a stale mapping never serves
            entry, length = self.cache.pool.longest_prefix(space, req.ids)
            if entry is not None:
                out.append(Held(entry, req.member, length, mapped=True))
        for member in sources:
            entry, length = self.cache.pool.longest_prefix(self.cache._exact_ns(self.cache.executor.info(member)), req.ids)
            if entry is not None:
                out.append(Held(entry, member, length))
        return out

    def _seed_for(self, req: CacheRequest, sources: list[str]) -> str | None:
        """The source, when a cold request on the member should be built there and mapped: a mapping is
        stored (no calibration on demand for it), its offline gate (when loaded) passes, its breaker is shut."""
        if not self.cache.policy.seed_source or req.member == self.cache.source or self.cache.source not in sources:
            return None
        source = self.cache.executor.info(self.cache.source)
        if self.cache.breaker.is_open((source.fingerprint, req.info.fingerprint)):
            return None
        loaded = self.cache.routes.loaded.get((source.fingerprint, req.info.fingerprint))
        if loaded is None:
            return self.cache.source if self.cache.mappings.has(source, req.info) else None
        offline = self.cache.routes.offline(req, loaded)
        return self.cache.source if offline is None or offline.passed else None

    def _seed(self, req: CacheRequest, route: Seed, flight: Flight) -> None:
        """Build the request's tokens exactly on the seed member (its steps are the request's, as is its pin)."""
        seed = CacheRequest(route.source, self.cache.executor.info(route.source), req.ids, req.gate, req.repair, req.tail,
                        req.step, cancel=req.cancel)
        try:
            self.cache.builds.run(seed, flight, self.cache._exact_build(seed, flight.member_ns, route.base, route.start),
                             computed=len(req.ids) - route.start)
        finally:
            req.pinned.extend(seed.pinned)  # kept until the request ends: the next plan maps this build
            req.prefill_s += seed.prefill_s

    def sources_for(self, target: str, target_info: ModelInfo) -> list[str]:
        """Members whose exact caches may be mapped into `target`."""
        out = []
        for member in [self.cache.source] + [m for m in self.cache.executor.members if m != self.cache.source]:
            if member == target:
                continue
            try:
                info = self.cache.executor.info(member)
            except OrchestraError:
                continue
            if info.fingerprint == target_info.fingerprint or info.tokenizer_digest != target_info.tokenizer_digest:
                continue
            if member != self.cache.source and not self.cache.mappings.has(info, target_info):
                continue
            out.append(member)
        return out
