"""Single-flight builds: each cache is built once however many requests want it at the same time.

A request whose route computes something registers a `Flight` (under `Builds.lock`, together with its
planning, so of concurrent requests exactly one builds); the others find it and wait, then plan again over
the entry it stored. A build holds its memory against the pool's budget before its K/V are an entry, so
decoding rows cannot take what it is about to need.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from orchestra.familycache._events import CacheStep, EvictDetail
from orchestra.familycache._request import CacheRequest, Flight

if TYPE_CHECKING:
    from orchestra.familycache._executor import Executor
    from orchestra.familycache._policy import CachePolicy
    from orchestra.familycache._pool import Entry, EntryPool, Namespace

__all__ = ["BUILD_MEMORY_FACTOR", "Builds"]

BUILD_MEMORY_FACTOR = 3.0
"""A build's peak memory over the K/V it leaves: the forward pass's activations live beside the growing cache
until it returns (`benchmarks/build_memory.py`: prefills of 1k to 4k tokens peak at 1.7x to 2.8x on CPU, maps at
up to 1.7x)."""


class Builds:
    """The builds in flight over one pool, and how a build runs, is stored and lets its waiters go."""

    def __init__(self, pool: EntryPool, executor: Executor, policy: CachePolicy,
                 on_stored: Callable[[Entry], None] | None = None) -> None:
        self.pool = pool
        self.executor = executor
        self.policy = policy
        self.on_stored = on_stored
        """Called with each entry stored (the disk tier writes it behind)."""
        self.lock = threading.Lock()
        """Held while a request plans and registers its build, so two requests never build one cache."""
        self.flights: set[Flight] = set()
        self._token_bytes: dict[str, float] = {}
        """Member -> K/V bytes per cached token, from its first entry (what a build of it will hold)."""

    def register(self, member_ns: Namespace, ids: tuple[int, ...], variant: str | None) -> Flight:
        """A new build of `ids` in `member_ns`, found by later requests (the caller holds `lock`)."""
        flight = Flight(member_ns, ids, variant)
        self.flights.add(flight)
        return flight

    def single_flight(self, req: CacheRequest, ns: Namespace, ids: tuple[int, ...],
                      build: Callable[[], Entry]) -> tuple[Entry, bool]:
        """Build the exact entry of `ids` outside a planned route (a shadow's reference), or wait for its build;
        True when it was waited for."""
        with self.lock:
            flight = next((f for f in self.flights if f.member_ns == ns and f.variant is None and f.ids == ids), None)
            owner = flight is None
            if flight is None:
                flight = self.register(ns, ids, None)
        if owner:
            return self.run(req, flight, build), False
        flight.done.wait()
        if flight.error is not None:
            raise flight.error
        assert flight.entry is not None
        self.pool.pin(flight.entry)
        req.pinned.append(flight.entry)
        req.step(CacheStep(step="join", member=req.member, tokens=len(ids), reused_tokens=len(ids)))
        return flight.entry, True

    def run(self, req: CacheRequest, flight: Flight, build: Callable[[], Entry], computed: int | None = None) -> Entry:
        """Build the registered `flight`'s entry, store it (pinned for the request), and let its waiters go.
        `computed`: the tokens the build runs the model over (None: all of them)."""
        held = self.build_bytes(req.member, len(flight.ids), len(flight.ids) if computed is None else computed)
        self.pool.hold(held)  # the build's K/V are memory before they are an entry: decoding rows must not take it
        try:
            try:
                entry = build()
            except BaseException:
                self.pool.release(held)
                raise
            if req.member not in self._token_bytes and entry.tokens:  # K/V alone: kept logits do not grow per token
                self._token_bytes[req.member] = self.executor.nbytes(entry.cache) / len(entry.tokens)
            self._store(req, entry, held)
            flight.entry = entry
            return entry
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            self.land(flight)

    def _store(self, req: CacheRequest, entry: Entry, held: int) -> None:
        if not self.policy.store:
            self.pool.release(held)
            entry.pins += 1
        else:
            for victim in self.pool.add(entry, pin=True, held=held):
                req.step(CacheStep(step="evict", member=victim.member, tokens=len(victim.tokens),
                                   detail=EvictDetail(bytes=victim.nbytes, kind=victim.namespace.kind)))
            if self.on_stored is not None and not entry.on_disk:
                self.on_stored(entry)
        req.pinned.append(entry)

    def build_bytes(self, member: str, tokens: int, computed: int) -> int:
        """What building a `tokens`-long entry of `member` over `computed` new tokens takes: the entry's K/V (per
        token as the member's first entry held; before one, from its config at 4 bytes an element) and the
        working memory of the forward pass over the computed tokens."""
        per_token = self._token_bytes.get(member)
        if per_token is None:
            from mappings.capture import kv_token_bytes

            per_token = float(kv_token_bytes(self.executor.info(member).config, 4))
        return int(per_token * (tokens + (BUILD_MEMORY_FACTOR - 1) * min(computed, tokens)))

    def land(self, flight: Flight) -> None:
        """The flight is over (built, failed or given up): no new request finds it, its waiters plan again."""
        with self.lock:
            self.flights.discard(flight)
        flight.done.set()
