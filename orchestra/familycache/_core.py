"""FamilyCache: (family member, token ids) -> a usable KV cache, by the cheapest trustworthy route.

Routes, tried in this order for each request:
1. **exact**: the longest cached prefix of the tokens on that member (any alias with the same
   fingerprint, dtype and RoPE), extended with the remaining tokens; a full match computes nothing;
2. **mapped**: when another member holds a longer prefix (by `CachePolicy.min_mapped_tokens`) and a
   mapping to this member exists, its cache is mapped across (an earlier map of the same prefix is
   reused), repaired per policy, and the trailing tokens are recomputed on the target; the
   remaining tokens are computed exactly on top; an adaptive repair policy (a ladder of budgets)
   climbs from its first budget until the probe gate passes, so each request spends the least
   that passes;
3. the mapped cache must pass the request's gates (offline, probe, shadow, circuit breaker);
   any failure, including a missing, stale or broken mapping, re-prefills on the target instead.

Every step is reported as a `CacheStep` with its cost. Concurrent requests for the same cache build it
once (single-flight); entries are pinned while leased and evicted least-recently-used beyond the
byte budget, which counts K/V, kept logits and hidden states. All model work goes through the
`Executor`, which holds each model's lock, so no two threads ever drive one model at once.
This is the only place in orchestra that maps, repairs, gates or falls back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Literal, cast

import structlog

from agents.bridge import run_in_thread
from orchestra.errors import DocumentError, OrchestraError
from orchestra.familycache._events import CacheStep
from orchestra.familycache._executor import Executor, LocalExecutor
from orchestra.familycache._mapped import MapJob, MappedPath, MappedPrefix
from orchestra.familycache._policy import CachePolicy
from orchestra.familycache._pool import Entry, EntryPool, Namespace, PoolStats, common_prefix
from orchestra.familycache._records import MappedFrom, ProbeReading
from orchestra.familycache._requests import (
    ComputeRequest,
    MappingRequest,
    TailLogitsRequest,
)
from orchestra.familycache._route import (
    Exact,
    Extend,
    Held,
    InFlight,
    Join,
    Map,
    Prefill,
    Route,
    RouteRequest,
    Seed,
    plan_route,
)
from orchestra.gates import CircuitBreaker, GateDecision, GatePolicy, decide_offline

if TYPE_CHECKING:
    from mappings.repair import RepairPolicy
    from mappings.types import JSONDict, KVCache, Tensor
    from orchestra.family.manifest import FamilyManifest
    from orchestra.familycache._disk import KVStore, StoredEntry
    from orchestra.familycache._handles import CacheRef, HiddenRef, MappingRef
    from orchestra.familycache._ops import Computed
    from orchestra.mapstore import MappingStore
    from orchestra.registry import ModelInfo, ModelRegistry

__all__ = ["FamilyCache", "CacheLease", "CachePath", "StepSink"]

log = structlog.get_logger("orchestra.cache")

BUILD_MEMORY_FACTOR = 3.0
"""A build's peak memory over the K/V it leaves: the forward pass's activations live beside the growing cache
until it returns (`benchmarks/build_memory.py`: prefills of 1k to 4k tokens peak at 1.7x to 2.8x on CPU, maps at
up to 1.7x)."""

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
        return [{"gate": d.gate, "passed": d.passed, "reason": d.reason, "metrics": d.metrics} for d in self.gates]

    def local_cache(self) -> KVCache:
        """The cache itself, for code that runs it in this process (an in-process executor's lease holds the
        cache; a Ray lease holds a handle to one in an actor, which is decoded there)."""
        if type(self.cache).__name__ == "RemoteKV":
            raise TypeError("this lease's cache lives in a Ray actor: run the op there (executor.run/stream)")
        return cast("KVCache", self.cache)


class _Flight:
    """A build in progress: `ids` on the member(s) of `member_ns`, exact (`variant` None) or mapped."""

    def __init__(self, member_ns: Namespace, ids: tuple[int, ...], variant: str | None) -> None:
        self.member_ns = member_ns
        """The exact namespace of the member it builds for (a map's own namespace needs the loaded mapping)."""
        self.ids = ids
        self.variant = variant
        """For a mapped build: the probe tail and repair policy that shape it (as `Namespace.variant`)."""
        self.done = threading.Event()
        self.entry: Entry | None = None
        self.error: BaseException | None = None


@dataclass
class _Request:
    member: str
    info: ModelInfo
    ids: tuple[int, ...]
    gate: GatePolicy
    repair: RepairPolicy | None
    tail: int
    sink: Callable[[CacheStep], None]
    cancel: threading.Event | None = None
    steps: list[CacheStep] = field(default_factory=list)
    prefill_s: float = 0.0
    map_s: float = 0.0
    pinned: list[Entry] = field(default_factory=list)
    decisions: list[GateDecision] = field(default_factory=list)
    joined: set[int] = field(default_factory=set)
    """Entries built by a flight of exactly these tokens this request waited for (served from them: not a hit)."""
    inline_tail: int = 0
    """The caller computes up to this many trailing tokens itself: the request may shrink to a shared prefix."""
    load_s: float = 0.0
    loaded_tokens: int = 0
    saved_s: float = 0.0

    def step(self, step: CacheStep) -> None:
        self.steps.append(step)
        self.sink(step)


class _MappingFailed(Exception):
    """A mapping could not be loaded or applied: a gate failure, never an agent failure."""


class FamilyCache:
    """The one component that turns (family member, token ids) into a cache lease."""

    def __init__(self, executor: Executor | ModelRegistry, mappings: MappingStore, *, source: str,
                 policy: CachePolicy | None = None, breaker: CircuitBreaker | None = None,
                 disk: KVStore | None = None) -> None:
        self.executor = executor if isinstance(executor, Executor) else LocalExecutor(executor)
        self.mappings = mappings
        self.source = source
        self.policy = policy or CachePolicy()
        self.breaker = breaker or CircuitBreaker()
        self.pool = EntryPool(self.policy.budget_bytes, self.policy.block_tokens)
        self._flights: set[_Flight] = set()
        self._token_bytes: dict[str, float] = {}
        """Member -> K/V bytes per cached token, from its first entry (what a build of it will hold)."""
        self._flight_lock = threading.Lock()
        self._loaded_mappings: dict[tuple[str, str], MappingRef] = {}
        self._rates: dict[str, float] = {}
        self.warnings: list[str] = []
        """Things a user should know (e.g. a mapping calibrated on demand), in order."""
        if disk is not None and not self.executor.in_process:
            self.warnings.append(f"the {self.executor.kind} executor keeps caches in its workers: the KV disk tier "
                                 f"{disk.directory} is not used")
            disk = None
        self.disk = disk
        """The disk tier: entries built here are written behind, and read back (by any process) before computing."""
        self._disk_lock = threading.Lock()

    @classmethod
    def for_family(cls, family: FamilyManifest, *, source: str = "root", members: dict[str, str] | None = None,
                   device: str = "auto", dtype: str = "float32", mapping_dir: str | None = None,
                   on_missing: Literal["calibrate", "refuse"] = "refuse",
                   policy: CachePolicy | None = None) -> FamilyCache:
        """A FamilyCache over a built family (``orchestra.family.load_family(home)`` reads one): members by role
        unless `members` is given. The caller reads the manifest: the cache core never reaches into the builder."""
        from pathlib import Path

        from orchestra.mapstore import MappingStore
        from orchestra.registry import ModelRegistry

        aliases = members or {record.role: name for name, record in family.members.items()}
        registry = ModelRegistry(aliases, family=family, default_device=device, dtype=dtype)
        registry.check_family(source)
        store = MappingStore(Path(mapping_dir) if mapping_dir else Path(family.home) / "mappings", on_missing=on_missing)
        return cls(registry, store, source=source, policy=policy)

    # -- public API -----------------------------------------------------------------------------
    @property
    def stats(self) -> PoolStats:
        return self.pool.stats

    @property
    def used_bytes(self) -> int:
        return self.pool.used_bytes

    def info(self, member: str) -> ModelInfo:
        return self.executor.info(member)

    def lock(self, member: str) -> threading.Lock:
        """The lock every forward pass on `member` takes (hand it to agents that decode on it)."""
        return self.executor.lock(member)

    async def acquire(self, member: str, token_ids: Sequence[int], *, gate: GatePolicy | None = None,
                      repair: RepairPolicy | None = None, tail_tokens: int | None = None, allow_mapped: bool = True,
                      reuse: bool = True, on_step: StepSink | None = None, inline_tail: int = 0) -> CacheLease:
        """`acquire_sync` in a worker thread; `on_step` is called from that thread.

        Cancelling the caller (Ctrl-C, a timeout) tells the worker to stop: an on-demand calibration ends at
        its next forward pass and saves nothing; the caller returns once the worker has stopped.
        """
        def work(cancel: threading.Event) -> CacheLease:
            return self.acquire_sync(member, token_ids, gate=gate, repair=repair, tail_tokens=tail_tokens,
                                     allow_mapped=allow_mapped, reuse=reuse, on_step=on_step, cancel=cancel,
                                     inline_tail=inline_tail)

        # cancelled: `cancel` is set and the worker waited for (a calibration checks it every forward pass; a job
        # still queued for a thread never starts); a lease it made meanwhile is released, nobody will get it
        return await run_in_thread(work, discard=CacheLease.release)

    def acquire_sync(self, member: str, token_ids: Sequence[int], *, gate: GatePolicy | None = None,
                     repair: RepairPolicy | None = None, tail_tokens: int | None = None, allow_mapped: bool = True,
                     reuse: bool = True, on_step: StepSink | None = None,
                     cancel: threading.Event | None = None, inline_tail: int = 0) -> CacheLease:
        """A lease on a cache holding exactly `token_ids` on `member` (blocking; thread-safe).

        `gate` guards a mapped cache (default: the policy's); `repair` overrides the policy's repair;
        `tail_tokens` (default: the policy's, and at least the probe's tokens) are recomputed on the
        target after a map. `allow_mapped=False` never maps; `reuse=False` computes everything
        from scratch and keeps nothing (the no-sharing baseline). Setting `cancel` (from another thread)
        stops an on-demand calibration this request started; the request then raises. `inline_tail` > 0: when
        all but at most that many trailing tokens are cached or being built (the shared document of concurrent
        conversations), the lease holds just that prefix (`lease.tokens` says how many; a prefix of an entry is
        views of it) and the caller computes the rest, so no entry of these tokens alone is stored.
        """
        info = self.executor.info(member)
        ids = tuple(int(t) for t in token_ids)
        if not ids:
            raise DocumentError("no tokens to cache: give at least one token id")
        if info.max_positions and len(ids) > info.max_positions:
            raise DocumentError(f"{len(ids)} tokens do not fit member {member!r}, which takes at most "
                                f"{info.max_positions} positions: shorten the input by {len(ids) - info.max_positions} tokens")
        gate = gate or self.policy.gate
        tail = max(tail_tokens or self.policy.tail_tokens, gate.probe.tokens if gate.probe else 2, 2)
        req = _Request(member, info, ids, gate, repair if repair is not None else self.policy.repair, tail,
                       on_step or (lambda step: None), cancel=cancel, inline_tail=inline_tail)
        started = time.perf_counter()
        try:
            lease = self._serve(req, allow_mapped, reuse)
        finally:
            for entry in req.pinned:
                self._unpin(entry)
        lease.seconds = time.perf_counter() - started
        lease.steps, lease.prefill_seconds, lease.map_seconds = req.steps, req.prefill_s, req.map_s
        lease.load_seconds, lease.saved_seconds = req.load_s, req.saved_s
        lease.loaded_tokens = min(req.loaded_tokens, lease.reused_tokens)
        return lease

    def prefill_estimate(self, member: str, tokens: int) -> float:
        """Seconds an exact prefill of `tokens` tokens takes on `member`: measured here, else scaled by weight size."""
        if member in self._rates:
            return self._rates[member] * tokens
        known = [(m, r) for m, r in self._rates.items()]
        if not known:
            return 0.0
        ref, rate = known[0]
        return rate * tokens * self.info(member).weight_bytes / max(1, self.info(ref).weight_bytes)

    def clear(self) -> None:
        """Drop every unpinned entry (the disk tier keeps its copies)."""
        self.pool.clear()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the disk tier's queued writes (True when there is none or all landed)."""
        return self.disk.flush(timeout) if self.disk is not None else True

    # -- routing --------------------------------------------------------------------------------
    def _serve(self, req: _Request, allow_mapped: bool, reuse: bool) -> CacheLease:
        """Plan a route (waiting for builds in flight it should reuse), carry it out, count the request once."""
        n = len(req.ids)
        if not reuse:
            computed = self._compute(req, req.ids, None, 0, req.tail)
            self.pool.stats.misses += 1
            return CacheLease(req.member, n, computed.cache, "exact", 0, n)
        mapped_ok = allow_mapped and not req.gate.force_reprefill
        if self.disk is not None:
            self._promote(req, mapped_ok)
        route, flight = self._plan_and_join(req, mapped_ok)
        refused: str | None = None
        lease: CacheLease | None = None
        if isinstance(route, (Map, Extend, Exact)) and (isinstance(route, Map) or route.mapped):
            lease, refused = self._carry_out_mapped(req, route, flight)
            if lease is None:  # refused: the member's own exact route, planned afresh (a shadow may have built it)
                route, flight = self._plan_and_join(req, False)
        elif allow_mapped and req.gate.force_reprefill and not isinstance(route, Exact):
            refused = "the gate policy forces re-prefill"
        if lease is None:
            assert isinstance(route, (Exact, Extend, Prefill)) and not (isinstance(route, (Exact, Extend)) and route.mapped)
            lease = self._carry_out_exact(req, route, flight, refused)
        stats = self.pool.stats
        stats.hits, stats.misses = stats.hits + lease.hit, stats.misses + (not lease.hit)
        stats.joins += any(step.step == "join" for step in req.steps)
        return lease

    def _plan_and_join(self, req: _Request, mapped_ok: bool) -> tuple[Route, _Flight | None]:
        """A route that is neither `Join` nor `Seed`: every build it names to wait for is waited for, the
        seed it names is built (once), then the plan is redone."""
        seed_ok = mapped_ok
        while True:
            route, flight = self._plan(req, mapped_ok, seed_ok)
            if isinstance(route, Seed):
                assert flight is not None
                seed_ok = False
                self._seed(req, route, flight)
                continue
            if not isinstance(route, Join):
                return route, flight
            t0 = time.perf_counter()
            waited: _Flight = route.flight
            with self._flight_lock:
                self.pool.stats.waiting += 1
            try:
                waited.done.wait()
            finally:
                with self._flight_lock:
                    self.pool.stats.waiting -= 1
            whole = waited.ids == req.ids and waited.member_ns == self._exact_ns(req.info)
            if waited.entry is not None and whole:
                req.joined.add(waited.entry.id)
            req.step(CacheStep(step="join", member=req.member, tokens=route.tokens,
                               reused_tokens=len(req.ids) if whole else 0, seconds=time.perf_counter() - t0,
                               detail={"waited_for": "mapped" if route.mapped else "exact", "prefix_of": route.tokens,
                                       "on": route.member}))

    def _plan(self, req: _Request, mapped_ok: bool, seed_ok: bool = False) -> tuple[Route, _Flight | None]:
        """`plan_route` over the pool and the builds in flight, and the build it plans registered, atomically.

        Looking up the builds in flight and registering this request's own happen under one lock, so of
        concurrent requests over one document exactly one builds it and the others wait for it (on this
        member) or for it then map it (on a member with a mapping from the builder's). The entries the
        route reuses are pinned before the lock is let go.
        """
        ns = self._exact_ns(req.info)
        sources = self._sources_for(req.member, req.info) if mapped_ok and len(req.ids) >= 3 else []
        spaces = {self._exact_ns(self.executor.info(m)): m for m in sources}
        variant = self._variant(req)
        seed = self._seed_for(req, sources) if seed_ok else None
        with self._flight_lock, self.pool.held_still():
            if req.inline_tail:
                self._shrink_to_shared(req, {ns} | set(spaces))
            held = self._held(req, ns, sources, variant if mapped_ok else None)
            flights = []
            for f in self._flights:
                if f.member_ns == ns and (f.variant is None or f.variant == variant):
                    flights.append(InFlight(f, req.member, f.ids, f.variant is not None))
                elif f.variant is None and f.member_ns in spaces:
                    flights.append(InFlight(f, spaces[f.member_ns], f.ids))
            route = plan_route(RouteRequest(req.member, req.ids, mapped_ok, self.policy.min_mapped_tokens, seed),
                               held, sources, flights)
            reused = {Exact: "entry", Extend: "base", Map: "source_entry", Seed: "base"}.get(type(route))
            if reused is not None and getattr(route, reused) is not None:
                entry: Entry = getattr(route, reused)
                self.pool.pin(entry)
                req.pinned.append(entry)
            if isinstance(route, (Join, Exact)):
                return route, None
            if isinstance(route, Seed):
                flight = _Flight(self._exact_ns(self.executor.info(route.source)), req.ids, None)
                self._flights.add(flight)
                return route, flight
            mapped = isinstance(route, Map) or (isinstance(route, Extend) and route.mapped)
            flight = _Flight(ns, req.ids, variant if mapped else None)
            self._flights.add(flight)
            return route, flight

    def _shrink_to_shared(self, req: _Request, spaces: set[Namespace]) -> None:
        """Cut the request to the longest prefix cached or in flight in `spaces` (or the member's mapped
        namespaces) when at most `inline_tail` tokens are left over; once, with the flight lock held, so of a
        cold burst only the first request builds its whole prompt and the others wait for its shared prefix."""
        limit, req.inline_tail = req.inline_tail, 0
        shared = 0
        for space in spaces | {s for s in self.pool.namespaces_for(req.info.fingerprint) if s.kind == "mapped"}:
            shared = max(shared, self.pool.longest_prefix(space, req.ids)[1])
        for flight in self._flights:
            if flight.member_ns in spaces:
                shared = max(shared, common_prefix(flight.ids, req.ids))
        if 0 < shared < len(req.ids) and len(req.ids) - shared <= limit:
            req.ids = req.ids[:shared]

    def _held(self, req: _Request, ns: Namespace, sources: list[str], variant: str | None) -> list[Held]:
        """What the pool holds for the request: its member's exact prefix, its usable mapped entries (when
        `variant` is given), the exact prefixes of `sources`."""
        out: list[Held] = []
        entry, length = self.pool.longest_prefix(ns, req.ids)
        if entry is not None:
            out.append(Held(entry, req.member, length))
        if variant is None:
            return out
        for space in self.pool.namespaces_for(req.info.fingerprint):
            if space.kind != "mapped" or space.variant != variant:
                continue
            current = self._loaded_mappings.get((space.source_fingerprint or "", req.info.fingerprint))
            if current is None or current.manifest.tensors.sha256 != space.mapping_id:
                continue  # a stale mapping never serves
            entry, length = self.pool.longest_prefix(space, req.ids)
            if entry is not None:
                out.append(Held(entry, req.member, length, mapped=True))
        for member in sources:
            entry, length = self.pool.longest_prefix(self._exact_ns(self.executor.info(member)), req.ids)
            if entry is not None:
                out.append(Held(entry, member, length))
        return out

    def _seed_for(self, req: _Request, sources: list[str]) -> str | None:
        """The source, when a cold request on the member should be built there and mapped: a mapping is
        stored (no calibration on demand for it), its offline gate (when loaded) passes, its breaker is shut."""
        if not self.policy.seed_source or req.member == self.source or self.source not in sources:
            return None
        source = self.executor.info(self.source)
        if self.breaker.is_open((source.fingerprint, req.info.fingerprint)):
            return None
        loaded = self._loaded_mappings.get((source.fingerprint, req.info.fingerprint))
        if loaded is None:
            return self.source if self.mappings.has(source, req.info) else None
        offline = self._offline(req, loaded)
        return self.source if offline is None or offline.passed else None

    def _seed(self, req: _Request, route: Seed, flight: _Flight) -> None:
        """Build the request's tokens exactly on the seed member (its steps are the request's, as is its pin)."""
        seed = _Request(route.source, self.executor.info(route.source), req.ids, req.gate, req.repair, req.tail,
                        req.step, cancel=req.cancel)
        try:
            self._run_flight(seed, flight, self._exact_build(seed, flight.member_ns, route.base, route.start),
                             computed=len(req.ids) - route.start)
        finally:
            req.pinned.extend(seed.pinned)  # kept until the request ends: the next plan maps this build
            req.prefill_s += seed.prefill_s

    def _sources_for(self, target: str, target_info: ModelInfo) -> list[str]:
        """Members whose exact caches may be mapped into `target`."""
        out = []
        for member in [self.source] + [m for m in self.executor.members if m != self.source]:
            if member == target:
                continue
            try:
                info = self.executor.info(member)
            except OrchestraError:
                continue
            if info.fingerprint == target_info.fingerprint or info.tokenizer_digest != target_info.tokenizer_digest:
                continue
            if member != self.source and not self.mappings.has(info, target_info):
                continue
            out.append(member)
        return out

    def _carry_out_exact(self, req: _Request, route: Exact | Extend | Prefill, flight: _Flight | None,
                         refused: str | None) -> CacheLease:
        """The member's own exact cache: reused whole, or computed over a prefix of it or from scratch."""
        n = len(req.ids)
        if isinstance(route, Exact):
            entry, reused = route.entry, n
        else:
            assert flight is not None
            base, start = (route.base, route.start) if isinstance(route, Extend) else (None, 0)
            build = self._exact_build(req, flight.member_ns, base, start)
            entry, reused = self._run_flight(req, flight, build, computed=n - start), start
        if refused is not None:
            req.step(CacheStep(step="fallback", member=req.member, tokens=n, reason=refused))
            log.info("cache_fallback", member=req.member, reason=refused)
            return self._lease(req, entry, "reprefilled", reused=reused, fallback=refused,
                               source=self._last_source(req), gates=req.decisions)
        if isinstance(route, Exact):
            return self._hit(req, entry, "exact")
        return self._lease(req, entry, "exact", reused=reused, gates=req.decisions)

    def _hit(self, req: _Request, entry: Entry, path: CachePath, gates: list[GateDecision] | None = None) -> CacheLease:
        """A lease on an entry holding every token: a hit, unless the entry is a build this request waited for."""
        n = len(req.ids)
        hit = entry.id not in req.joined
        if hit:
            req.step(CacheStep(step="hit", member=req.member, tokens=n, reused_tokens=n,
                               detail={"entry_tokens": len(entry.tokens), "kind": entry.namespace.kind}))
        lease = self._lease(req, entry, path, reused=n, gates=gates)
        lease.hit = hit
        return lease

    def _lease(self, req: _Request, entry: Entry, path: CachePath, *, reused: int, fallback: str | None = None,
               source: str | None = None, gates: list[GateDecision] | None = None) -> CacheLease:
        n = len(req.ids)
        cache = entry.cache if len(entry.tokens) == n else self.executor.truncate(req.member, entry.cache, n)
        self.pool.pin(entry)
        mapped = entry.mapped if path == "mapped" else None
        return CacheLease(
            member=req.member, tokens=n, cache=cache, path=path, reused_tokens=min(reused, n),
            computed_tokens=max(0, n - reused), source=source or (entry.mapped.source if entry.mapped else None),
            mapping=mapped.mapping_path if mapped else None, gates=list(gates or []), fallback_reason=fallback,
            repair=mapped.repair.model_dump() if mapped and mapped.repair else None,
            tail_tokens=mapped.tail if mapped else 0, entry_id=entry.id,
            _release=lambda: self._unpin(entry),
        )

    def _unpin(self, entry: Entry) -> None:
        for victim in self.pool.unpin(entry):
            log.debug("cache_evicted", member=victim.member, tokens=len(victim.tokens), bytes=victim.nbytes)

    def _last_source(self, req: _Request) -> str | None:
        for step in reversed(req.steps):
            if step.source:
                return step.source
        return None

    # -- disk tier ------------------------------------------------------------------------------
    def _promote(self, req: _Request, mapped_ok: bool) -> None:
        """Read into memory the disk entry holding the longest prefix of the request beyond what memory holds.

        Candidates are the member's own exact entries, its mapped entries of the mappings loaded now (a mapped
        entry of a mapping that changed is deleted, never served), and the exact entries of members it maps
        from; on a tie the member's own cache wins, then a mapped one. The planner then routes over memory
        as always (a mapped entry read from disk is still served as mapped, through its gates).
        """
        disk = self.disk
        assert disk is not None
        found: list[tuple[int, int, Namespace, StoredEntry, str]] = []

        def consider(space: Namespace, member: str, rank: int) -> None:
            stored, length = disk.find(space, req.ids)
            if stored is None or length < disk.min_tokens:
                return
            if length > self.pool.longest_prefix(space, req.ids)[1]:
                found.append((length, -rank, space, stored, member))

        try:
            consider(self._exact_ns(req.info), req.member, 0)
            if mapped_ok and len(req.ids) >= 3:
                sources = self._sources_for(req.member, req.info)
                by_fingerprint = {self.executor.info(m).fingerprint: m for m in sources}
                variant = self._variant(req)
                for space in disk.namespaces_for(req.info.fingerprint):
                    source = by_fingerprint.get(space.source_fingerprint or "")
                    if space.kind != "mapped" or source is None or space.variant != variant:
                        continue
                    mapping = self._stored_mapping(source, req)
                    if mapping is None:
                        continue
                    if (space.mapping_id, space.mapping_version) != (mapping.manifest.tensors.sha256,
                                                                      mapping.manifest.mapping_version):
                        disk.drop_namespace(space)  # made by a mapping since replaced: never served again
                        continue
                    consider(space, req.member, 1)
                for source in sources:  # a source cache read for a layer repair would lack its hidden states
                    if not self._wants_hidden(source, req.repair):
                        consider(self._exact_ns(self.executor.info(source)), source, 2)
        except OSError as exc:  # an unreadable store is a miss, never a failed request
            log.warning("kv_store_unreadable", error=str(exc))
            return
        if not found:
            return
        length, _, space, stored, member = max(found, key=lambda c: (c[0], c[1]))
        with self._disk_lock:  # concurrent requests for one document read it once
            if self.pool.longest_prefix(space, req.ids)[1] >= length:
                return
            t0 = time.perf_counter()
            loaded = disk.load(stored)
            if loaded is None:
                req.step(CacheStep(step="load", member=req.member, tokens=0, reason="the stored cache was corrupt "
                                   "or gone: deleted, computing instead", detail={"from": "disk"}))
                return
            cache = self.executor.import_cache(member, loaded.layers)
            mapped = self._mapped_from_disk(loaded.mapped, member, req) if space.kind == "mapped" else None
            if space.kind == "mapped" and mapped is None:
                return
            entry = Entry(space, member, stored.tokens, cache, self._nbytes(cache, loaded.tail_logits),
                          tail_logits=loaded.tail_logits, logits_end=loaded.logits_end, mapped=mapped,
                          seconds=loaded.seconds, on_disk=True)
            for victim in self.pool.add(entry, pin=True):
                req.step(CacheStep(step="evict", member=victim.member, tokens=len(victim.tokens),
                                   detail={"bytes": victim.nbytes, "kind": victim.namespace.kind}))
            req.pinned.append(entry)
            seconds = time.perf_counter() - t0
        if space.kind == "exact" and len(stored.tokens) >= 64 and loaded.seconds > 0:
            self._rates.setdefault(member, loaded.seconds / len(stored.tokens))  # what prefill_estimate saved
        req.load_s += seconds
        req.loaded_tokens = max(req.loaded_tokens, length)
        req.saved_s += loaded.seconds * length / max(1, len(stored.tokens))
        req.step(CacheStep(step="load", member=req.member, tokens=length, reused_tokens=length, seconds=seconds,
                           source=member if member != req.member else None,
                           detail={"from": "disk", "kind": space.kind, "entry_tokens": len(stored.tokens),
                                   "bytes": stored.nbytes, "key": stored.key}))
        log.info("cache_loaded", member=req.member, tokens=length, kind=space.kind, seconds=round(seconds, 3))

    def _stored_mapping(self, source: str, req: _Request) -> MappingRef | None:
        """The mapping source -> member when one is stored (a disk entry never makes one calibrate on demand)."""
        s, t = self.executor.info(source), req.info
        if (s.fingerprint, t.fingerprint) not in self._loaded_mappings and not self.mappings.has(s, t):
            return None
        try:
            return self._mapping(source, req.member, req.cancel)
        except _MappingFailed:
            return None

    def _mapped_from_disk(self, record: dict[str, object] | None, source_of_entry: str,
                          req: _Request) -> MappedFrom | None:
        """A mapped entry's record as read back, naming this process's source member and mapping folder."""
        if not record:
            return None
        try:
            source_fp = str(record["source_fingerprint"])
            source = next(m for m in self._sources_for(req.member, req.info)
                          if self.executor.info(m).fingerprint == source_fp)
            mapping = self._loaded_mappings.get((source_fp, req.info.fingerprint))
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

    def _write_behind(self, entry: Entry) -> None:
        """Queue a built entry for the disk tier (it never blocks the request)."""
        disk = self.disk
        assert disk is not None
        if len(entry.tokens) < disk.min_tokens:
            return
        try:
            layers = self.executor.export_cache(entry.member, entry.cache)
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

    # -- exact ----------------------------------------------------------------------------------
    def _exact_ns(self, info: ModelInfo) -> Namespace:
        return Namespace("exact", info.fingerprint, self._dtype(info), info.rope)

    def _dtype(self, info: ModelInfo) -> str:
        return self.executor.dtype(info.alias)

    def _wants_hidden(self, member: str, repair: RepairPolicy | None) -> bool:
        return (member == self.source and repair is not None and repair.budget > 0
                and (repair.layer_share > 0 or bool(repair.blocks)))

    def _exact_build(self, req: _Request, ns: Namespace, base: Entry | None, base_len: int,
                     ids: tuple[int, ...] | None = None) -> Callable[[], Entry]:
        """How to build the exact entry of `ids` (default: the request's) on the member over `base`'s first tokens."""
        ids = ids or req.ids

        def build() -> Entry:
            start = base_len if base is not None and base_len < len(ids) else 0
            hidden = self._wants_hidden(req.member, req.repair) and (start == 0 or (base is not None and base.hidden))
            computed = self._compute(req, ids, base.cache if start and base is not None else None, start, req.tail,
                                     base.hidden if start and base is not None else None, bool(hidden))
            if start == 0 and len(ids) >= 64:
                self._rates[req.member] = computed.seconds / len(ids)
            return Entry(ns, req.member, ids, computed.cache, self._nbytes(computed.cache, computed.logits,
                                                                             computed.hidden),
                         tail_logits=computed.logits, logits_end=len(ids), hidden=computed.hidden,
                         seconds=computed.seconds)

        return build

    def _compute(self, req: _Request, ids: Sequence[int], base: CacheRef | None, start: int, keep: int,
                 base_hidden: HiddenRef | None = None, want_hidden: bool = False, over: str | None = None) -> Computed:
        """ids[start:] computed exactly on the member over `base`, charged to the request and reported as a step."""
        computed = self.executor.compute(ComputeRequest(req.member, tuple(ids), base, start, keep, base_hidden,
                                                        want_hidden))
        req.prefill_s += computed.seconds
        req.step(CacheStep(step="prefill", member=req.member, tokens=len(ids) - start, reused_tokens=start,
                           seconds=computed.seconds, detail={"over": over} if over else {}))
        return computed

    def _nbytes(self, cache: CacheRef, *extra: Tensor | HiddenRef | None) -> int:
        return self.executor.nbytes(cache, *extra)  # a remote executor measures its handles without fetching them

    def _single_flight(self, req: _Request, ns: Namespace, ids: tuple[int, ...],
                       build: Callable[[], Entry]) -> tuple[Entry, bool]:
        """Build the exact entry of `ids` outside a planned route (a shadow's reference): or wait for its build."""
        with self._flight_lock:
            flight = next((f for f in self._flights if f.member_ns == ns and f.variant is None and f.ids == ids), None)
            owner = flight is None
            if flight is None:
                flight = _Flight(ns, ids, None)
                self._flights.add(flight)
        if owner:
            return self._run_flight(req, flight, build), False
        flight.done.wait()
        if flight.error is not None:
            raise flight.error
        assert flight.entry is not None
        self.pool.pin(flight.entry)
        req.pinned.append(flight.entry)
        req.step(CacheStep(step="join", member=req.member, tokens=len(ids), reused_tokens=len(ids)))
        return flight.entry, True

    def _run_flight(self, req: _Request, flight: _Flight, build: Callable[[], Entry], computed: int | None = None) -> Entry:
        """Build the registered `flight`'s entry, store it (pinned for the request), and let its waiters go.
        `computed`: the tokens the build runs the model over (None: all of them)."""
        held = self._build_bytes(req.member, len(flight.ids), len(flight.ids) if computed is None else computed)
        self.pool.hold(held)  # the build's K/V are memory before they are an entry: decoding rows must not take it
        try:
            try:
                entry = build()
            except BaseException:
                self.pool.release(held)
                raise
            if req.member not in self._token_bytes and entry.tokens:  # K/V alone: kept logits do not grow per token
                self._token_bytes[req.member] = self._nbytes(entry.cache) / len(entry.tokens)
            if not self.policy.store:
                self.pool.release(held)
                entry.pins += 1
            else:
                evicted = self.pool.add(entry, pin=True, held=held)
                for victim in evicted:
                    req.step(CacheStep(step="evict", member=victim.member, tokens=len(victim.tokens),
                                       detail={"bytes": victim.nbytes, "kind": victim.namespace.kind}))
                if self.disk is not None and not entry.on_disk:
                    self._write_behind(entry)
            req.pinned.append(entry)
            flight.entry = entry
            return entry
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            self._land(flight)

    def _build_bytes(self, member: str, tokens: int, computed: int) -> int:
        """What building a `tokens`-long entry of `member` over `computed` new tokens takes: the entry's K/V (per
        token as the member's first entry held; before one, from its config at 4 bytes an element) and the
        working memory of the forward pass over the computed tokens."""
        per_token = self._token_bytes.get(member)
        if per_token is None:
            from mappings.capture import kv_token_bytes

            per_token = float(kv_token_bytes(self.executor.info(member).config, 4))
        return int(per_token * (tokens + (BUILD_MEMORY_FACTOR - 1) * min(computed, tokens)))

    def _land(self, flight: _Flight) -> None:
        """The flight is over (built, failed or given up): no new request finds it, its waiters plan again."""
        with self._flight_lock:
            self._flights.discard(flight)
        flight.done.set()

    # -- mapped ---------------------------------------------------------------------------------
    def _variant(self, req: _Request) -> str:
        repair = req.repair
        if repair is None or (repair.budget == 0 and not repair.adaptive):
            return f"tail={req.tail}"
        if repair.adaptive:  # where a ladder stops depends on the gate it climbs against
            gate = req.gate.model_dump_json(include={"offline", "probe"})
            return f"tail={req.tail};{repair.model_dump_json()};gate={gate}"
        return f"tail={req.tail};{repair.model_dump_json()}"

    @property
    def _mapped_path(self) -> MappedPath:
        """The mapped path over this cache's executor, store and policy (as they are now: tests swap policies)."""
        return MappedPath(self.executor, self.mappings, self.policy, self._costs_dir())

    def _costs_dir(self) -> str | None:
        """Where measured pass costs are kept: beside the mappings (None: a store without a folder)."""
        directory = getattr(self.mappings, "directory", None)
        return str(directory / "pass-costs") if directory is not None else None

    def _mapping(self, source: str, target: str, cancel: threading.Event | None = None) -> MappingRef:
        s, t = self.executor.info(source), self.executor.info(target)
        key = (s.fingerprint, t.fingerprint)
        if key not in self._loaded_mappings:
            try:
                loaded = self.executor.load_mapping(MappingRequest(source, target, self.mappings, cancel))
                mapping, calibrated = loaded.mapping, loaded.calibrated
            except Exception as exc:  # a missing, stale, corrupt or refused mapping is a gate failure
                if cancel is not None and cancel.is_set():
                    raise  # the request was cancelled: stop, do not fall back
                raise _MappingFailed(f"no usable mapping {s.name} -> {t.name}: {_why(exc)}") from exc
            if calibrated:
                self.warnings.append(f"no mapping for {s.name} -> {t.name}: calibrated one on demand "
                                     f"(do this offline with `orchestra family calibrate`)")
            self._loaded_mappings[key] = mapping
        return self._loaded_mappings[key]

    def _carry_out_mapped(self, req: _Request, route: Map | Extend | Exact,
                          flight: _Flight | None) -> tuple[CacheLease | None, str | None]:
        """A gated mapped lease, or (None, why it was refused); a refused route's flight is landed empty."""
        if isinstance(route, Map):
            source = route.source
        else:
            source = _mapped_of(route.entry if isinstance(route, Exact) else route.base).source
        pair = (self.executor.info(source).fingerprint, req.info.fingerprint)
        try:
            if self.breaker.is_open(pair):
                return None, "circuit breaker open for this pair after shadow failures"
            try:
                mapping = self._mapping(source, req.member, req.cancel)
                offline = self._offline(req, mapping)
                if offline is not None and not offline.passed:  # no map, repair or probe changes the manifest
                    req.decisions.append(offline)
                    self._record(req, [offline], source)
                    return None, f"offline gate failed: {offline.reason}"
                if isinstance(route, Exact):
                    entry = route.entry
                elif isinstance(route, Extend):
                    assert flight is not None
                    entry = self._run_flight(req, flight, self._extend_mapped(req, route.base, route.start),
                                             computed=len(req.ids) - route.start)
                else:
                    assert flight is not None
                    entry = self._run_flight(req, flight, self._map_build(req, source, route.source_entry,
                                                                          route.length, mapping))
            except _MappingFailed as exc:
                req.decisions.append(GateDecision(False, "mapping", str(exc)))
                req.step(CacheStep(step="gate", member=req.member, passed=False, reason=f"mapping: {exc}",
                                   source=source))
                return None, f"mapping gate failed: {exc}"
        finally:
            if flight is not None and not flight.done.is_set():
                self._land(flight)  # refused before building: its waiters plan again
        decisions = self._gates(req, entry, pair, offline)
        req.decisions.extend(decisions)
        failed = [d for d in decisions if not d.passed]
        if failed:
            repair = _mapped_of(entry).repair
            note = repair.ladder.refusal_note() if repair is not None and repair.ladder is not None else ""
            return None, f"{failed[0].gate} gate failed: {failed[0].reason}" + note
        if isinstance(route, Exact):
            return self._hit(req, entry, "mapped", gates=decisions), None
        reused = route.start if isinstance(route, Extend) else _mapped_of(entry).carried_tokens
        return self._lease(req, entry, "mapped", reused=reused, gates=decisions), None

    def _mapped_ns(self, req: _Request, source: str, mapping: MappingRef) -> Namespace:
        s = self.executor.info(source)
        return Namespace("mapped", req.info.fingerprint, self._dtype(req.info), req.info.rope,
                         source_fingerprint=s.fingerprint, mapping_id=mapping.manifest.tensors.sha256,
                         mapping_version=mapping.manifest.mapping_version, variant=self._variant(req))

    def _map_build(self, req: _Request, source: str, src_entry: Entry, length: int,
                   mapping: MappingRef) -> Callable[[], Entry]:
        """How to map `source`'s first `length` tokens into the member, repair them and compute the rest."""
        ns = self._mapped_ns(req, source, mapping)
        prefix = req.ids[:length]

        def build() -> Entry:
            tail = max(2, min(req.tail, length - 1))
            kept = src_entry.tail_logits
            src_logits = kept[-tail:] if kept is not None and src_entry.logits_end == length \
                and kept.shape[0] >= tail else \
                self.executor.tail_logits(TailLogitsRequest(source, src_entry.cache, prefix, length, tail)).logits
            job = MapJob(req.member, source, prefix, self.executor.truncate(source, src_entry.cache, length), tail,
                         req.repair, req.gate.probe, src_logits, src_entry.hidden)
            try:
                mapped = self._mapped_path.map(job, mapping)
            except Exception as exc:  # any failure to map (bad tensors, I/O, shapes) is a gate failure
                raise _MappingFailed(f"mapping {source} -> {req.member} failed: {_why(exc)}") from exc
            self.warnings.extend(mapped.warnings)
            return self._mapped_entry(req, ns, job, mapping, mapped)

        return build

    def _mapped_entry(self, req: _Request, ns: Namespace, job: MapJob, mapping: MappingRef,
                      mapped: MappedPrefix) -> Entry:
        """The entry of a map that was made: its steps reported, the request's rest computed exactly after it."""
        length, seconds = len(job.prefix), mapped.computed.seconds
        req.map_s += seconds
        req.step(CacheStep(step="map", member=req.member, source=job.source, tokens=length, seconds=seconds,
                           detail={"mapping": str(getattr(mapping, "path", "") or ""), "tail": mapped.tail,
                                   "exact_sinks": mapped.sinks}))
        if mapped.repair is not None:
            req.step(CacheStep(step="repair", member=req.member, source=job.source, tokens=mapped.repair.tokens,
                               seconds=mapped.repair.total_seconds, detail=mapped.repair.model_dump()))
        cache, logits = mapped.computed.cache, mapped.computed.logits
        if len(req.ids) > length:
            cache = self._compute(req, req.ids, cache, length, 0, over="mapped").cache
        made = MappedFrom(source=job.source, source_fingerprint=self.executor.info(job.source).fingerprint,
                          mapping_id=mapping.manifest.tensors.sha256,
                          mapping_path=str(mapping.path) if getattr(mapping, "path", None) else None,
                          mapped_tokens=length, tail=mapped.tail, exact_sinks=mapped.sinks, probe=mapped.probe,
                          repair=mapped.repair, seconds=seconds)
        return Entry(ns, req.member, req.ids, cache, self._nbytes(cache, logits), tail_logits=logits,
                     logits_end=length, mapped=made, seconds=seconds)

    def _extend_mapped(self, req: _Request, base: Entry, length: int) -> Callable[[], Entry]:
        """How to extend an earlier map of a prefix on this member exactly with the remaining tokens."""

        def build() -> Entry:
            more = self._compute(req, req.ids, base.cache, length, 0, over="mapped")
            made = _mapped_of(base)
            made = replace(made, mapped_tokens=min(length, made.mapped_tokens))
            tail_logits = base.tail_logits if base.logits_end <= length else None
            return Entry(base.namespace, req.member, req.ids, more.cache, self._nbytes(more.cache, tail_logits),
                         tail_logits=tail_logits, logits_end=base.logits_end if tail_logits is not None else 0,
                         mapped=made, seconds=more.seconds)

        return build

    # -- gates ----------------------------------------------------------------------------------
    def _offline(self, req: _Request, mapping: MappingRef) -> GateDecision | None:
        """The offline gate's decision on `mapping` (None when the gate is off).

        It is decided before the map: the manifest's held-out metrics are all it reads, so a mapping it
        refuses would only cost a map (seconds at long context) and a probe before the same fallback.
        """
        if req.gate.offline is None:
            return None
        heldout = mapping.manifest.heldout
        return decide_offline(req.gate.offline, heldout.get("kl"), heldout.get("top1"))

    def _record(self, req: _Request, decisions: list[GateDecision], source: str | None) -> None:
        """One `gate` (or `shadow`) step per decision."""
        for d in decisions:
            req.step(CacheStep(step="shadow" if d.gate == "shadow" else "gate", member=req.member, passed=d.passed,
                               reason=f"{d.gate}: {d.reason}", metrics=d.metrics, source=source))

    def _gates(self, req: _Request, entry: Entry, pair: tuple[str, str],
               offline: GateDecision | None) -> list[GateDecision]:
        """The gates on a mapped `entry`: the offline decision taken before the map (it passed), then the rest."""
        policy = req.gate
        decisions: list[GateDecision] = [offline] if offline is not None else []
        made = _mapped_of(entry)
        if policy.probe is not None:
            if made.probe is None:
                decisions.append(GateDecision(False, "probe", "no probe measurement (the prefix is shorter than the probe)"))
            else:
                decisions.append(made.probe.decide(policy.probe))
        if policy.shadow is not None and entry.tail_logits is not None and self.breaker.should_shadow(policy.shadow):
            decisions.append(self._shadow(req, entry, pair))
        self._record(req, decisions, made.source)
        return decisions

    def _shadow(self, req: _Request, entry: Entry, pair: tuple[str, str]) -> GateDecision:
        """Re-prefill the member on the mapped prefix and compare next-token distributions over the probe tail."""
        from mappings.metrics import mean_kl

        policy = req.gate.shadow
        assert policy is not None
        assert entry.tail_logits is not None  # the caller shadows only entries that kept their tail logits
        mapped_logits = entry.tail_logits
        end, tail = entry.logits_end, int(mapped_logits.shape[0])
        prefix = req.ids[:end]
        ns = self._exact_ns(req.info)
        base, base_len = self.pool.longest_prefix(ns, prefix, pin=True)
        if base is not None:
            req.pinned.append(base)
        exact, _ = self._single_flight(req, ns, prefix,
                                       self._exact_build(req, ns, base, base_len if base_len < end else 0, ids=prefix))
        if exact.tail_logits is not None and exact.logits_end == end and exact.tail_logits.shape[0] >= tail:
            reference = exact.tail_logits[-tail:]
        else:
            reference = self.executor.tail_logits(TailLogitsRequest(req.member, exact.cache, prefix, end, tail)).logits
        kl = mean_kl(reference, mapped_logits)
        passed = kl <= policy.max_kl
        opened = self.breaker.record(pair, passed, policy)
        return GateDecision(passed, "shadow", f"shadow KL {kl:.4f} {'<=' if passed else '>'} {policy.max_kl}"
                            + ("; breaker opened" if opened else ""), {"shadow_kl": kl, **self.breaker.stats(pair)})


def _why(exc: BaseException) -> str:
    """An exception as a reason: the project's typed errors by message, anything else with its type."""
    from mappings.errors import MappingError

    if isinstance(exc, (OrchestraError, MappingError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _mapped_of(entry: Entry) -> MappedFrom:
    """What a mapped entry knows of how it was made (an entry reached by a mapped route always has it)."""
    assert entry.mapped is not None, "a mapped route reached an exact entry"
    return entry.mapped

