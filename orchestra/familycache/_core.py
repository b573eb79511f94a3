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
A gate that can only decide after a mapped cache was used (the answer gate) settles its lease here
(`settle`), so this is the only place in orchestra that maps, repairs, gates or falls back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from agents.bridge import run_in_thread
from orchestra._logging import get_logger
from orchestra.errors import DocumentError
from orchestra.familycache._disk_tier import DiskTier
from orchestra.familycache._events import CacheStep, HitDetail, PrefillDetail
from orchestra.familycache._executor import Executor, LocalExecutor
from orchestra.familycache._flights import Builds
from orchestra.familycache._lease import CacheLease, CachePath, StepSink
from orchestra.familycache._mapped_routes import MappedRoutes
from orchestra.familycache._planner import Planner
from orchestra.familycache._policy import CachePolicy
from orchestra.familycache._pool import Entry, EntryPool, Namespace, PoolStats
from orchestra.familycache._request import CacheRequest, Flight
from orchestra.familycache._requests import ComputeRequest
from orchestra.familycache._route import Exact, Extend, Map, Prefill
from orchestra.familycache.gates import CircuitBreaker, GateDecision, GatePolicy
from orchestra.models.registry import FamilyMember

if TYPE_CHECKING:
    from mappings.repair import RepairPolicy
    from mappings.types import Tensor
    from orchestra.familycache._disk import KVStore
    from orchestra.familycache._handles import CacheRef, HiddenRef, MappingRef
    from orchestra.familycache._ops import Computed
    from orchestra.familycache.mapping_store import MappingStore
    from orchestra.models.registry import ModelInfo, ModelRegistry

__all__ = ["FamilyCache", "CacheLease", "CachePath", "StepSink"]

log = get_logger("orchestra.cache")


class _Member(FamilyMember, Protocol):
    """What `FamilyCache.for_family` reads of a member's record (``orchestra.family.MemberRecord``): the
    registry's view of it, and its role."""

    @property
    def role(self) -> str: ...


class BuiltFamily(Protocol):
    """What `FamilyCache.for_family` reads of a family (``orchestra.family.FamilyManifest``): the cache core takes
    it from its caller and never imports the family builder."""

    @property
    def home(self) -> str: ...

    @property
    def members(self) -> Mapping[str, _Member]: ...

    def member(self, key: str) -> FamilyMember: ...


class FamilyCache:
    """The one component that turns (family member, token ids) into a cache lease.

    It composes parts with one job each: the `Planner` (which route), `Builds` (single flight), the
    `MappedRoutes` (mappings, maps, gates) and the `DiskTier`; it keeps the requests' entry points, the
    member's own exact route and the leases.
    """

    def __init__(self, executor: Executor | ModelRegistry, mappings: MappingStore, *, source: str,
                 policy: CachePolicy | None = None, breaker: CircuitBreaker | None = None,
                 disk: KVStore | None = None) -> None:
        self.executor = executor if isinstance(executor, Executor) else LocalExecutor(executor)
        self.mappings = mappings
        self.source = source
        self.policy = policy or CachePolicy()
        self.breaker = breaker or CircuitBreaker()
        self.pool = EntryPool(self.policy.budget_bytes, self.policy.block_tokens)
        self._rates: dict[str, float] = {}
        self.warnings: list[str] = []
        """Things a user should know (e.g. a mapping calibrated on demand), in order."""
        if disk is not None and not self.executor.in_process:
            self.warnings.append(f"the {self.executor.kind} executor keeps caches in its workers: the KV disk tier "
                                 f"{disk.directory} is not used")
            disk = None
        self.disk = disk
        """The disk tier: entries built here are written behind, and read back (by any process) before computing."""
        self.disk_tier = DiskTier(disk, self) if disk is not None else None
        self.builds = Builds(self.pool, self.executor, self.policy,
                             on_stored=self.disk_tier.write_behind if self.disk_tier is not None else None)
        """The builds in flight (single flight: one build per cache, however many requests want it)."""
        self.planner = Planner(self)
        self.routes = MappedRoutes(self)
        """The mapped routes: the mappings loaded, the maps built, the gates decided."""

    @classmethod
    def for_family(cls, family: BuiltFamily, *, source: str = "root", members: dict[str, str] | None = None,
                   device: str = "auto", dtype: str = "float32", mapping_dir: str | None = None,
                   on_missing: Literal["calibrate", "refuse"] = "refuse",
                   policy: CachePolicy | None = None, disk: KVStore | None = None) -> FamilyCache:
        """A FamilyCache over a built family (``orchestra.family.load_family(home)`` reads one): members by role
        unless `members` is given. The caller reads the manifest: the cache core never reaches into the builder."""
        from pathlib import Path

        from orchestra.familycache.mapping_store import MappingStore
        from orchestra.models.registry import ModelRegistry

        aliases = members or {record.role: name for name, record in family.members.items()}
        registry = ModelRegistry(aliases, family=family, default_device=device, dtype=dtype)
        registry.check_family(source)
        store = MappingStore(Path(mapping_dir) if mapping_dir else Path(family.home) / "mappings", on_missing=on_missing)
        return cls(registry, store, source=source, policy=policy, disk=disk)

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
        req = self._request(member, token_ids, gate, repair, tail_tokens, on_step, cancel, inline_tail)
        return self._finish(req, lambda: self._serve(req, allow_mapped, reuse))

    async def settle(self, lease: CacheLease, decision: GateDecision, token_ids: Sequence[int], *,
                     on_step: StepSink | None = None) -> CacheLease:
        """`settle_sync` in a worker thread; `on_step` is called from that thread."""
        def work(cancel: threading.Event) -> CacheLease:
            return self.settle_sync(lease, decision, token_ids, on_step=on_step, cancel=cancel)

        # cancelled meanwhile: the own prefill it handed out is released, nobody will get it
        return await run_in_thread(work, discard=CacheLease.release)

    def settle_sync(self, lease: CacheLease, decision: GateDecision, token_ids: Sequence[int], *,
                    on_step: StepSink | None = None, cancel: threading.Event | None = None) -> CacheLease:
        """A gate that can only decide after the mapped cache was used (the answer gate reads the reply decoded on
        it) settles `lease`, a mapped lease on `token_ids`: the decision is announced as a `gate` step and joins
        the lease's gates. Passed, `lease` is returned as it is. Refused, `lease` is released and the member's own
        prefill of the same tokens is handed out (reused where it is cached) as a `reprefilled` lease that names
        the refusal as its fallback reason, as a refusal by the gates checked before use does."""
        if lease.path != "mapped":
            raise ValueError(f"only a mapped lease is settled by a later gate; this one is {lease.path}")
        if len(token_ids) != lease.tokens:
            raise ValueError(f"the lease holds {lease.tokens} tokens, not the {len(token_ids)} given: settle it on "
                             "the token ids it was acquired for")
        req = self._request(lease.member, token_ids, None, None, None, on_step, cancel, 0)
        req.decisions = [*lease.gates, decision]
        req.step(CacheStep(step="gate", member=lease.member, passed=decision.passed,
                           reason=f"{decision.gate}: {decision.reason}", metrics=decision.metrics, source=lease.source))
        if decision.passed:
            lease.gates, lease.steps = req.decisions, [*lease.steps, *req.steps]
            return lease
        lease.release()
        refused = f"{decision.gate} gate failed: {decision.reason}"
        return self._finish(req, lambda: self._serve(req, False, True, refused=refused))

    def _request(self, member: str, token_ids: Sequence[int], gate: GatePolicy | None, repair: RepairPolicy | None,
                 tail_tokens: int | None, on_step: StepSink | None, cancel: threading.Event | None,
                 inline_tail: int) -> CacheRequest:
        """A checked request for `token_ids` on `member`, with the policy's defaults filled in."""
        info = self.executor.info(member)
        ids = tuple(int(t) for t in token_ids)
        if not ids:
            raise DocumentError("no tokens to cache: give at least one token id")
        if info.max_positions and len(ids) > info.max_positions:
            raise DocumentError(f"{len(ids)} tokens do not fit member {member!r}, which takes at most "
                                f"{info.max_positions} positions: shorten the input by {len(ids) - info.max_positions} tokens")
        gate = gate or self.policy.gate
        tail = max(tail_tokens or self.policy.tail_tokens, gate.probe.tokens if gate.probe else 2, 2)
        return CacheRequest(member, info, ids, gate, repair if repair is not None else self.policy.repair, tail,
                            on_step or (lambda step: None), cancel=cancel, inline_tail=inline_tail)

    def _finish(self, req: CacheRequest, serve: Callable[[], CacheLease]) -> CacheLease:
        """Serve `req` (unpinning what it pinned on the way) and put its costs and steps on the lease."""
        started = time.perf_counter()
        try:
            lease = serve()
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

    def measured_prefill(self, member: str, seconds: float, tokens: int) -> None:
        """A prefill of `tokens` tokens on `member` took `seconds` elsewhere (an engine that keeps its own caches):
        `prefill_estimate` scales from it, as from the prefills this cache runs."""
        if tokens > 0 and seconds > 0:
            self._rates[member] = seconds / tokens

    def clear(self) -> None:
        """Drop every unpinned entry (the disk tier keeps its copies)."""
        self.pool.clear()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the disk tier's queued writes (True when there is none or all landed)."""
        return self.disk_tier.flush(timeout) if self.disk_tier is not None else True

    def load_mapping(self, source: str, target: str) -> MappingRef:
        """The mapping `source` -> `target` loaded now (calibrated if the store does that); the pair's mapped
        requests use it. A missing or broken one raises, as its gate would refuse it."""
        return self.routes.mapping(source, target)

    def _serve(self, req: CacheRequest, allow_mapped: bool, reuse: bool, refused: str | None = None) -> CacheLease:
        """Plan a route (waiting for builds in flight it should reuse), carry it out, count the request once.
        `refused`: a mapped cache of these tokens was already refused for this reason (`settle`): the member's own
        route, reported as the fallback."""
        n = len(req.ids)
        if not reuse:
            computed = self._compute(req, req.ids, None, 0, req.tail)
            self.pool.stats.misses += 1
            return CacheLease(req.member, n, computed.cache, "exact", 0, n)
        mapped_ok = allow_mapped and refused is None and not req.gate.force_reprefill
        if self.disk_tier is not None:
            self.disk_tier.promote(req, mapped_ok)
        route, flight = self.planner.plan_and_join(req, mapped_ok)
        lease: CacheLease | None = None
        if isinstance(route, (Map, Extend, Exact)) and (isinstance(route, Map) or route.mapped):
            lease, refused = self.routes.carry_out(req, route, flight)
            if lease is None:  # refused: the member's own exact route, planned afresh (a shadow may have built it)
                route, flight = self.planner.plan_and_join(req, False)
        elif allow_mapped and req.gate.force_reprefill and not isinstance(route, Exact):
            refused = "the gate policy forces re-prefill"
        if lease is None:
            assert isinstance(route, (Exact, Extend, Prefill)) and not (isinstance(route, (Exact, Extend)) and route.mapped)
            lease = self._carry_out_exact(req, route, flight, refused)
        stats = self.pool.stats
        stats.hits, stats.misses = stats.hits + lease.hit, stats.misses + (not lease.hit)
        stats.joins += any(step.step == "join" for step in req.steps)
        return lease

    def _carry_out_exact(self, req: CacheRequest, route: Exact | Extend | Prefill, flight: Flight | None,
                         refused: str | None) -> CacheLease:
        """The member's own exact cache: reused whole, or computed over a prefix of it or from scratch."""
        n = len(req.ids)
        if isinstance(route, Exact):
            entry, reused = route.entry, n
        else:
            assert flight is not None
            base, start = (route.base, route.start) if isinstance(route, Extend) else (None, 0)
            build = self._exact_build(req, flight.member_ns, base, start)
            entry, reused = self.builds.run(req, flight, build, computed=n - start), start
        if refused is not None:
            req.step(CacheStep(step="fallback", member=req.member, tokens=n, reason=refused))
            log.info("cache_fallback", member=req.member, reason=refused)
            return self._lease(req, entry, "reprefilled", reused=reused, fallback=refused,
                               source=self._last_source(req), gates=req.decisions)
        if isinstance(route, Exact):
            return self._hit(req, entry, "exact")
        return self._lease(req, entry, "exact", reused=reused, gates=req.decisions)

    def _hit(self, req: CacheRequest, entry: Entry, path: CachePath, gates: list[GateDecision] | None = None) -> CacheLease:
        """A lease on an entry holding every token: a hit, unless the entry is a build this request waited for."""
        n = len(req.ids)
        hit = entry.id not in req.joined
        if hit:
            req.step(CacheStep(step="hit", member=req.member, tokens=n, reused_tokens=n,
                               detail=HitDetail(entry_tokens=len(entry.tokens), kind=entry.namespace.kind)))
        lease = self._lease(req, entry, path, reused=n, gates=gates)
        lease.hit = hit
        return lease

    def _lease(self, req: CacheRequest, entry: Entry, path: CachePath, *, reused: int, fallback: str | None = None,
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

    def _last_source(self, req: CacheRequest) -> str | None:
        for step in reversed(req.steps):
            if step.source:
                return step.source
        return None

    def exact_namespace(self, member: str) -> Namespace:
        """The namespace of `member`'s own exact caches (in memory and in the disk tier)."""
        return self._exact_ns(self.executor.info(member))

    def _exact_ns(self, info: ModelInfo) -> Namespace:
        return Namespace("exact", info.fingerprint, self._dtype(info), info.rope)

    def _dtype(self, info: ModelInfo) -> str:
        return self.executor.dtype(info.alias)

    def _wants_hidden(self, member: str, repair: RepairPolicy | None) -> bool:
        return (member == self.source and repair is not None and repair.budget > 0
                and (repair.layer_share > 0 or bool(repair.blocks)))

    def _exact_build(self, req: CacheRequest, ns: Namespace, base: Entry | None, base_len: int,
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

    def _compute(self, req: CacheRequest, ids: Sequence[int], base: CacheRef | None, start: int, keep: int,
                 base_hidden: HiddenRef | None = None, want_hidden: bool = False, over: str | None = None) -> Computed:
        """ids[start:] computed exactly on the member over `base`, charged to the request and reported as a step."""
        computed = self.executor.compute(ComputeRequest(req.member, tuple(ids), base, start, keep, base_hidden,
                                                        want_hidden))
        req.prefill_s += computed.seconds
        req.step(CacheStep(step="prefill", member=req.member, tokens=len(ids) - start, reused_tokens=start,
                           seconds=computed.seconds, detail=PrefillDetail(over="mapped") if over else None))
        return computed

    def _nbytes(self, cache: CacheRef, *extra: Tensor | HiddenRef | None) -> int:
        return self.executor.nbytes(cache, *extra)  # a remote executor measures its handles without fetching them

    def _costs_dir(self) -> str | None:
        """Where measured pass costs are kept: beside the mappings (None: a store without a folder)."""
        directory = getattr(self.mappings, "directory", None)
        return str(directory / "pass-costs") if directory is not None else None
