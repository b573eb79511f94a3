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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.to_thread
import structlog

from orchestra.errors import DocumentError, OrchestraError
from orchestra.familycache._events import CacheStep
from orchestra.familycache._executor import Executor, LocalExecutor
from orchestra.familycache._policy import CachePolicy
from orchestra.familycache._pool import Entry, EntryPool, Namespace, PoolStats, common_prefix, token_hash
from orchestra.gates import CircuitBreaker, GateDecision, GatePolicy, ProbeCheck, decide_offline, decide_probe

if TYPE_CHECKING:
    from mappings.repair import RepairPolicy
    from orchestra.mapstore import MappingStore
    from orchestra.registry import ModelInfo, ModelRegistry

__all__ = ["FamilyCache", "CacheLease", "CachePath", "StepSink"]

log = structlog.get_logger("orchestra.cache")

CachePath = Literal["exact", "mapped", "reprefilled"]
StepSink = Callable[[CacheStep], None]


@dataclass
class CacheLease:
    """A cache of exactly `tokens` positions on `member`, held until released; read it, never modify it.

    Agents copy it before extending it. While the lease is held its entry cannot be evicted.
    """

    member: str
    tokens: int
    cache: Any
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
    repair: dict[str, Any] | None = None
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
    steps: list[CacheStep] = field(default_factory=list)
    _release: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Unpin the entry (idempotent); the lease's cache stays usable by whoever still holds it."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> CacheLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> CacheLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def gate_dicts(self) -> list[dict[str, Any]]:
        return [{"gate": d.gate, "passed": d.passed, "reason": d.reason, "metrics": d.metrics} for d in self.gates]


class _Flight:
    def __init__(self, ns: Namespace, ids: tuple[int, ...]) -> None:
        self.ns = ns
        self.ids = ids
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

    def step(self, step: CacheStep) -> None:
        self.steps.append(step)
        self.sink(step)


class _MappingFailed(Exception):
    """A mapping could not be loaded or applied: a gate failure, never an agent failure."""


class FamilyCache:
    """The one component that turns (family member, token ids) into a cache lease."""

    def __init__(self, executor: Executor | ModelRegistry, mappings: MappingStore, *, source: str,
                 policy: CachePolicy | None = None, breaker: CircuitBreaker | None = None) -> None:
        self.executor = executor if isinstance(executor, Executor) else LocalExecutor(executor)
        self.mappings = mappings
        self.source = source
        self.policy = policy or CachePolicy()
        self.breaker = breaker or CircuitBreaker()
        self.pool = EntryPool(self.policy.budget_bytes, self.policy.block_tokens)
        self._flights: dict[tuple[Namespace, str], _Flight] = {}
        self._flight_lock = threading.Lock()
        self._loaded_mappings: dict[tuple[str, str], Any] = {}
        self._rates: dict[str, float] = {}
        self.warnings: list[str] = []
        """Things a user should know (e.g. a mapping calibrated on demand), in order."""

    @classmethod
    def for_family(cls, family: Any = None, *, home: str | None = None, source: str = "root",
                   members: dict[str, str] | None = None, device: str = "auto", dtype: str = "float32",
                   mapping_dir: str | None = None, on_missing: Literal["calibrate", "refuse"] = "refuse",
                   policy: CachePolicy | None = None) -> FamilyCache:
        """A FamilyCache over a built family (the bundled one by default): members by role unless `members` is given."""
        from pathlib import Path

        from orchestra.mapstore import MappingStore
        from orchestra.registry import ModelRegistry

        if family is None:
            from orchestra.family.manifest import load_family

            family = load_family(home)
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
                      reuse: bool = True, on_step: StepSink | None = None) -> CacheLease:
        """`acquire_sync` in a worker thread; `on_step` is called from that thread.

        Cancelling the caller (Ctrl-C, a timeout) tells the worker to stop: an on-demand calibration ends at
        its next forward pass and saves nothing; the caller returns once the worker has stopped.
        """
        cancel, finished, phase = threading.Event(), threading.Event(), threading.Lock()
        box: dict[str, Any] = {"state": "pending"}

        def work() -> CacheLease:
            with phase:
                if box["state"] == "abandoned":  # cancelled before this thread picked the job up
                    raise anyio.get_cancelled_exc_class()()
                box["state"] = "running"
            try:
                box["lease"] = self.acquire_sync(member, token_ids, gate=gate, repair=repair, tail_tokens=tail_tokens,
                                                 allow_mapped=allow_mapped, reuse=reuse, on_step=on_step, cancel=cancel)
                return box["lease"]
            finally:
                finished.set()

        try:
            return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            cancel.set()
            with phase:
                started = box["state"] == "running"
                box["state"] = "abandoned"
            if started:  # wait for the worker to stop (promptly: a calibration checks `cancel` every forward pass)
                with anyio.CancelScope(shield=True):
                    while not finished.is_set():
                        await anyio.sleep(0.02)
            if "lease" in box:
                box["lease"].release()
            raise

    def acquire_sync(self, member: str, token_ids: Sequence[int], *, gate: GatePolicy | None = None,
                     repair: RepairPolicy | None = None, tail_tokens: int | None = None, allow_mapped: bool = True,
                     reuse: bool = True, on_step: StepSink | None = None,
                     cancel: threading.Event | None = None) -> CacheLease:
        """A lease on a cache holding exactly `token_ids` on `member` (blocking; thread-safe).

        `gate` guards a mapped cache (default: the policy's); `repair` overrides the policy's repair;
        `tail_tokens` (default: the policy's, and at least the probe's tokens) are recomputed on the
        target after a map. `allow_mapped=False` never maps; `reuse=False` computes everything
        from scratch and keeps nothing (the no-sharing baseline). Setting `cancel` (from another thread)
        stops an on-demand calibration this request started; the request then raises.
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
                       on_step or (lambda step: None), cancel=cancel)
        started = time.perf_counter()
        try:
            lease = self._serve(req, allow_mapped, reuse)
        finally:
            for entry in req.pinned:
                self._unpin(entry)
        lease.seconds = time.perf_counter() - started
        lease.steps, lease.prefill_seconds, lease.map_seconds = req.steps, req.prefill_s, req.map_s
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
        """Drop every unpinned entry."""
        self.pool.clear()

    # -- routing --------------------------------------------------------------------------------
    def _serve(self, req: _Request, allow_mapped: bool, reuse: bool) -> CacheLease:
        n = len(req.ids)
        ns = self._exact_ns(req.info)
        if not reuse:
            computed = self._compute(req, req.ids, None, 0, req.tail)
            self.pool.stats.misses += 1
            return CacheLease(req.member, n, computed.cache, "exact", 0, n)
        base, base_len = self.pool.longest_prefix(ns, req.ids, pin=True)
        if base is not None:
            req.pinned.append(base)
        for _ in range(8):  # a longer prefix being built right now (here or on a mapping source): wait for it
            if base is not None and base_len == n:
                break
            flight = self._inflight_prefix(req, base_len, allow_mapped and not req.gate.force_reprefill)
            if flight is None:
                break
            t0 = time.perf_counter()
            flight.done.wait()
            req.step(CacheStep(step="join", member=req.member, tokens=len(flight.ids), seconds=time.perf_counter() - t0,
                               detail={"waited_for": flight.ns.kind, "prefix_of": len(flight.ids)}))
            base, base_len = self.pool.longest_prefix(ns, req.ids, pin=True)
            if base is not None:
                req.pinned.append(base)
        if base is not None and base_len == n:
            return self._hit(req, base, "exact")
        self.pool.stats.misses += 1
        refused: str | None = None
        if allow_mapped and req.gate.force_reprefill:
            refused = "the gate policy forces re-prefill"
        elif allow_mapped and n >= 3:
            option = self._mapped_option(req, base_len)
            if option is not None:
                lease, refused = self._try_mapped(req, option)
                if lease is not None:
                    return lease
        if refused is not None:  # a shadow sample may have just built it
            base, base_len = self.pool.longest_prefix(ns, req.ids, pin=True)
            if base is not None:
                req.pinned.append(base)
        if base is not None and base_len == n:
            entry, joined = base, True
        else:
            entry, joined = self._exact_entry(req, ns, base, base_len)
        if refused is not None:
            req.step(CacheStep(step="fallback", member=req.member, tokens=n, reason=refused))
            log.info("cache_fallback", member=req.member, reason=refused)
        path: CachePath = "reprefilled" if refused is not None else "exact"
        return self._lease(req, entry, path, reused=base_len if not joined else n, fallback=refused,
                           source=self._last_source(req) if refused else None, gates=req.decisions)

    def _inflight_prefix(self, req: _Request, have: int, mapped: bool) -> _Flight | None:
        """A build in flight whose tokens share a prefix with the request longer (by `min_mapped_tokens`) than
        what is cached: on this member, or on a member this one can map from. Concurrent requests about one
        document (with different questions, or on different members) then prefill it once, not once each."""
        spaces = {self._exact_ns(req.info)}
        if mapped:
            for member in self._sources_for(req):
                spaces.add(self._exact_ns(self.executor.info(member)))
        need = have + self.policy.min_mapped_tokens
        best, best_len = None, 0
        with self._flight_lock:
            flights = [f for f in self._flights.values() if f.ns in spaces and not f.done.is_set()]
        for flight in flights:
            common = common_prefix(flight.ids, req.ids)
            if common >= need and common > best_len:
                best, best_len = flight, common
        return best

    def _sources_for(self, req: _Request) -> list[str]:
        """Members whose exact caches may be mapped into the request's member."""
        out = []
        for member in [self.source] + [m for m in self.executor.members if m != self.source]:
            if member == req.member:
                continue
            try:
                info = self.executor.info(member)
            except OrchestraError:
                continue
            if info.fingerprint == req.info.fingerprint or info.tokenizer_digest != req.info.tokenizer_digest:
                continue
            if member != self.source and not self.mappings.has(info, req.info):
                continue
            out.append(member)
        return out

    def _hit(self, req: _Request, entry: Entry, path: CachePath) -> CacheLease:
        self.pool.stats.hits += 1
        n = len(req.ids)
        req.step(CacheStep(step="hit", member=req.member, tokens=n, reused_tokens=n,
                           detail={"entry_tokens": len(entry.tokens), "kind": entry.namespace.kind}))
        lease = self._lease(req, entry, path, reused=n)
        lease.hit = True
        return lease

    def _lease(self, req: _Request, entry: Entry, path: CachePath, *, reused: int, fallback: str | None = None,
               source: str | None = None, gates: list[GateDecision] | None = None) -> CacheLease:
        n = len(req.ids)
        cache = entry.cache if len(entry.tokens) == n else self.executor.run([req.member], _truncate_op, entry.cache, n)
        self.pool.pin(entry)
        meta = entry.meta
        return CacheLease(
            member=req.member, tokens=n, cache=cache, path=path, reused_tokens=min(reused, n),
            computed_tokens=max(0, n - reused), source=source or meta.get("source"),
            mapping=meta.get("mapping") if path == "mapped" else None, gates=list(gates or []),
            fallback_reason=fallback, repair=meta.get("repair") if path == "mapped" else None,
            tail_tokens=meta.get("tail", 0) if path == "mapped" else 0, entry_id=entry.id,
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

    # -- exact ----------------------------------------------------------------------------------
    def _exact_ns(self, info: ModelInfo) -> Namespace:
        return Namespace("exact", info.fingerprint, self._dtype(info), info.rope)

    def _dtype(self, info: ModelInfo) -> str:
        return self.executor.dtype(info.alias)

    def _wants_hidden(self, member: str, repair: RepairPolicy | None) -> bool:
        return (member == self.source and repair is not None and repair.budget > 0
                and (repair.layer_share > 0 or bool(repair.blocks)))

    def _exact_entry(self, req: _Request, ns: Namespace, base: Entry | None, base_len: int,
                     ids: tuple[int, ...] | None = None) -> tuple[Entry, bool]:
        """The exact entry for `ids` (default: the request's) on the member: built once however many ask."""
        ids = ids or req.ids

        def build() -> Entry:
            start = base_len if base is not None and base_len < len(ids) else 0
            hidden = self._wants_hidden(req.member, req.repair) and (start == 0 or (base is not None and base.hidden))
            computed = self._compute(req, ids, base.cache if start else None, start, req.tail,
                                     base.hidden if start and base is not None else None, bool(hidden))
            if start == 0 and len(ids) >= 64:
                self._rates[req.member] = computed.seconds / len(ids)
            return Entry(ns, req.member, ids, computed.cache, self._nbytes(computed.cache, computed.logits,
                                                                             computed.hidden),
                         tail_logits=computed.logits, logits_end=len(ids), hidden=computed.hidden,
                         meta={"seconds": computed.seconds})

        return self._single_flight(req, ns, ids, build)

    def _compute(self, req: _Request, ids: Sequence[int], base: Any, start: int, keep: int,
                 base_hidden: dict[int, Any] | None = None, want_hidden: bool = False, over: str | None = None) -> Any:
        """ids[start:] computed exactly on the member over `base`, charged to the request and reported as a step."""
        computed = self.executor.run([req.member], _compute_op, list(ids), base, start, keep, base_hidden, want_hidden)
        req.prefill_s += computed.seconds
        req.step(CacheStep(step="prefill", member=req.member, tokens=len(ids) - start, reused_tokens=start,
                           seconds=computed.seconds, detail={"over": over} if over else {}))
        return computed

    def _nbytes(self, cache: Any, *extra: Any) -> int:
        return self.executor.nbytes(cache, *extra)  # a remote executor measures its handles without fetching them

    def _single_flight(self, req: _Request, ns: Namespace, ids: tuple[int, ...],
                       build: Callable[[], Entry]) -> tuple[Entry, bool]:
        key = (ns, token_hash(ids))
        with self._flight_lock:
            flight = self._flights.get(key)
            owner = flight is None
            if owner:
                flight = self._flights[key] = _Flight(ns, ids)
        assert flight is not None
        if not owner:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            assert flight.entry is not None
            self.pool.pin(flight.entry)
            req.pinned.append(flight.entry)
            req.step(CacheStep(step="join", member=req.member, tokens=len(ids), reused_tokens=len(ids)))
            return flight.entry, True
        try:
            entry = build()
            if self.policy.store:
                evicted = self.pool.add(entry, pin=True)
                for victim in evicted:
                    req.step(CacheStep(step="evict", member=victim.member, tokens=len(victim.tokens),
                                       detail={"bytes": victim.nbytes, "kind": victim.namespace.kind}))
            else:
                entry.pins += 1
            req.pinned.append(entry)
            flight.entry = entry
            return entry, False
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._flight_lock:
                self._flights.pop(key, None)
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

    def _mapped_option(self, req: _Request, exact_len: int) -> tuple[str, Entry, int] | None:
        """The best cross-member start: ('entry', a mapped entry of this member, its match) or ('source', ...)."""
        need = exact_len + self.policy.min_mapped_tokens
        best: tuple[str, Entry, int] | None = None
        variant = self._variant(req)
        for ns in self.pool.namespaces_for(req.info.fingerprint):
            if ns.kind != "mapped" or ns.variant != variant:
                continue
            current = self._loaded_mappings.get((ns.source_fingerprint or "", req.info.fingerprint))
            if current is None or current.manifest.tensors.sha256 != ns.mapping_id:
                continue
            entry, length = self.pool.longest_prefix(ns, req.ids, pin=True)
            if entry is None:
                continue
            req.pinned.append(entry)
            if length >= need and (best is None or length > best[2]):
                best = ("entry", entry, length)
        for member in self._sources_for(req):
            info = self.executor.info(member)
            entry, length = self.pool.longest_prefix(self._exact_ns(info), req.ids, pin=True)
            if entry is None:
                continue
            req.pinned.append(entry)
            if length >= max(need, 3) and (best is None or length > best[2]):
                best = ("source", entry, length)
        return best

    def _costs_dir(self) -> str | None:
        """Where measured pass costs are kept: beside the mappings (None: a store without a folder)."""
        directory = getattr(self.mappings, "directory", None)
        return str(directory / "pass-costs") if directory is not None else None

    def _mapping(self, source: str, target: str, cancel: threading.Event | None = None) -> Any:
        s, t = self.executor.info(source), self.executor.info(target)
        key = (s.fingerprint, t.fingerprint)
        if key not in self._loaded_mappings:
            try:
                mapping, calibrated = self.executor.run([source, target], _mapping_op, self.mappings, cancel)
            except Exception as exc:  # a missing, stale, corrupt or refused mapping is a gate failure
                if cancel is not None and cancel.is_set():
                    raise  # the request was cancelled: stop, do not fall back
                raise _MappingFailed(f"no usable mapping {s.name} -> {t.name}: {_why(exc)}") from exc
            if calibrated:
                self.warnings.append(f"no mapping for {s.name} -> {t.name}: calibrated one on demand "
                                     f"(do this offline with `orchestra family calibrate`)")
            self._loaded_mappings[key] = mapping
        return self._loaded_mappings[key]

    def _try_mapped(self, req: _Request, option: tuple[str, Entry, int]) -> tuple[CacheLease | None, str | None]:
        """A gated mapped lease, or (None, why it was refused)."""
        kind, start_entry, length = option
        source = start_entry.member if kind == "source" else start_entry.meta["source"]
        s_info = self.executor.info(source)
        pair = (s_info.fingerprint, req.info.fingerprint)
        if self.breaker.is_open(pair):
            return None, "circuit breaker open for this pair after shadow failures"
        try:
            mapping = self._mapping(source, req.member, req.cancel)
            offline = self._offline(req, mapping)
            if offline is not None and not offline.passed:  # no map, repair or probe changes the manifest
                req.decisions.append(offline)
                self._record(req, [offline], source)
                return None, f"offline gate failed: {offline.reason}"
            if kind == "entry":
                entry, joined = self._extend_mapped(req, start_entry, length)
            else:
                entry, joined = self._map_entry(req, source, start_entry, length, mapping)
        except _MappingFailed as exc:
            req.decisions.append(GateDecision(False, "mapping", str(exc)))
            req.step(CacheStep(step="gate", member=req.member, passed=False, reason=f"mapping: {exc}", source=source))
            return None, f"mapping gate failed: {exc}"
        decisions = self._gates(req, entry, pair, offline)
        req.decisions.extend(decisions)
        failed = [d for d in decisions if not d.passed]
        if failed:
            return None, f"{failed[0].gate} gate failed: {failed[0].reason}" + _ladder_note(entry.meta.get("repair"))
        if joined:
            reused = len(req.ids)
        elif kind == "entry":
            reused = length
        else:  # a fresh map: the sinks and the tail were recomputed, the rest was carried across
            reused = entry.meta["mapped_tokens"] - entry.meta["tail"] - entry.meta.get("exact_sinks", 0)
        if kind == "entry" and length == len(req.ids):
            self.pool.stats.hits += 1
            self.pool.stats.misses -= 1
            req.step(CacheStep(step="hit", member=req.member, tokens=len(req.ids), reused_tokens=len(req.ids),
                               detail={"entry_tokens": len(entry.tokens), "kind": "mapped"}))
        lease = self._lease(req, entry, "mapped", reused=reused, gates=decisions, source=source)
        lease.hit = kind == "entry" and length == len(req.ids)
        return lease, None

    def _mapped_ns(self, req: _Request, source: str, mapping: Any) -> Namespace:
        s = self.executor.info(source)
        return Namespace("mapped", req.info.fingerprint, self._dtype(req.info), req.info.rope,
                         source_fingerprint=s.fingerprint, mapping_id=mapping.manifest.tensors.sha256,
                         mapping_version=mapping.manifest.mapping_version, variant=self._variant(req))

    def _map_entry(self, req: _Request, source: str, src_entry: Entry, length: int, mapping: Any) -> tuple[Entry, bool]:
        ns = self._mapped_ns(req, source, mapping)
        prefix = req.ids[:length]

        def build() -> Entry:
            tail = max(2, min(req.tail, length - 1))
            src_ids = list(prefix)
            if src_entry.tail_logits is not None and src_entry.logits_end == length \
                    and src_entry.tail_logits.shape[0] >= tail:
                src_logits = src_entry.tail_logits[-tail:]
            else:
                computed = self.executor.run([source], _tail_op, src_entry.cache, src_ids, length, tail)
                src_logits = computed.logits
            repair = req.repair
            hidden = src_entry.hidden  # the ops cut it to the mapped positions where it lives
            if repair is not None and repair.budget > 0 and (repair.layer_share > 0 or repair.blocks):
                if mapping.residual is None or hidden is None:
                    why = ("the mapping has no residual maps (run `orchestra calibrate-repair`)"
                           if mapping.residual is None else "the source cache was built without hidden states")
                    self.warnings.append(f"{req.member}: layer repair skipped, {why}; repairing tokens only")
                    repair = repair.model_copy(update={"layer_share": 0.0, "blocks": None})
            from mappings.metrics import tail_nll

            src_cache = self.executor.run([source], _truncate_op, src_entry.cache, length)
            tail_ids = prefix[-tail:]
            # at least the sinks the map was fitted without (it is only good with them), never into the tail
            wanted = max(self.policy.sink_tokens, _fitted_sinks(mapping))
            sinks = min(wanted, max(0, length - tail))
            costs = None
            if repair is not None and (repair.adaptive or repair.budget > 0) and self.policy.repair_costs == "measured":
                costs = self.executor.run([req.member], _costs_op, self._costs_dir())
            try:
                ref = self.executor.run([source, req.member], _reference_op, self.mappings, mapping, tail)
                check = ProbeCheck(tuple(tail_ids), src_logits, tail_nll(src_logits, _tensor(tail_ids)) + ref.offset_nll,
                                   ref.source_kl)
                if repair is not None and repair.adaptive:
                    # the probe it climbs against; an offline refusal never gets here (decided before the map)
                    climb = req.gate.probe
                    if climb is None:  # nothing to climb against: the ladder's first budget, as a fixed policy
                        repair = repair.at(repair.budget)
                    else:
                        check = ProbeCheck(check.tail_ids, check.source_logits, check.reference_nll,
                                           check.reference_source_kl, climb)
                if repair is not None and repair.adaptive:
                    importance, rank_s = None, 0.0
                    if repair.scattered_share > 0 and repair.max_budget > 0:  # ranked where the source lives
                        importance, rank_s = self.executor.run([source], _importance_op, src_cache, src_ids,
                                                               repair.probe_tokens)
                    mapped, summary = self.executor.run([req.member], _map_target_op, mapping, src_cache, src_ids,
                                                        tail, repair, hidden, importance, check, sinks=sinks,
                                                        costs=costs)
                    if summary is not None and importance is not None:
                        summary.setdefault("seconds", {})["rank"] = rank_s
                elif repair is not None and repair.budget > 0 and repair.scattered_share > 0:
                    mapped, summary = self.executor.run([source, req.member], _map_op, mapping, src_cache, src_ids,
                                                        tail, repair, hidden, sinks=sinks, costs=costs)
                else:
                    mapped, summary = self.executor.run([req.member], _map_target_op, mapping, src_cache, src_ids,
                                                        tail, repair, hidden, sinks=sinks, costs=costs)
            except Exception as exc:  # any failure to map (bad tensors, I/O, shapes) is a gate failure
                raise _MappingFailed(f"mapping {source} -> {req.member} failed: {_why(exc)}") from exc
            probe = {**check.metrics(mapped.logits), "reference_source_kl": ref.source_kl,
                     "calibrated_mapped_excess": ref.mapped_excess_nll}
            req.map_s += mapped.seconds
            req.step(CacheStep(step="map", member=req.member, source=source, tokens=length, seconds=mapped.seconds,
                               detail={"mapping": str(getattr(mapping, "path", "") or ""), "tail": tail,
                                       "exact_sinks": sinks}))
            if summary is not None:
                req.step(CacheStep(step="repair", member=req.member, source=source, tokens=summary.get("tokens", 0),
                                   seconds=sum(summary.get("seconds", {}).values()), detail=summary))
            cache, logits = mapped.cache, mapped.logits
            extra = len(req.ids) - length
            if extra:
                cache = self._compute(req, req.ids, cache, length, 0, over="mapped").cache
            meta = {"source": source, "mapping": str(mapping.path) if getattr(mapping, "path", None) else None,
                    "probe": probe, "repair": summary, "tail": tail, "mapped_tokens": length,
                    "exact_sinks": sinks,
                    "seconds": mapped.seconds}
            return Entry(ns, req.member, req.ids, cache, self._nbytes(cache, logits), tail_logits=logits,
                         logits_end=length, meta=meta)

        return self._single_flight(req, ns, req.ids, build)

    def _extend_mapped(self, req: _Request, base: Entry, length: int) -> tuple[Entry, bool]:
        """An earlier map of a prefix on this member, extended exactly with the remaining tokens."""
        if length == len(req.ids):
            return base, True

        def build() -> Entry:
            more = self._compute(req, req.ids, base.cache, length, 0, over="mapped")
            meta = dict(base.meta, mapped_tokens=min(length, base.meta.get("mapped_tokens", length)))
            tail_logits = base.tail_logits if base.logits_end <= length else None
            return Entry(base.namespace, req.member, req.ids, more.cache, self._nbytes(more.cache, tail_logits),
                         tail_logits=tail_logits, logits_end=base.logits_end if tail_logits is not None else 0,
                         meta=meta)

        entry, joined = self._single_flight(req, base.namespace, req.ids, build)
        entry.meta.setdefault("reused_from_map", length)
        return entry, joined

    # -- gates ----------------------------------------------------------------------------------
    def _offline(self, req: _Request, mapping: Any) -> GateDecision | None:
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
        if policy.probe is not None:
            probe = entry.meta.get("probe")
            if not probe:
                decisions.append(GateDecision(False, "probe", "no probe measurement (the prefix is shorter than the probe)"))
            else:
                decisions.append(decide_probe(policy.probe, probe["probe_nll"], probe["reference_nll"],
                                              probe["probe_source_kl"], probe["reference_source_kl"]))
        if policy.shadow is not None and entry.tail_logits is not None and self.breaker.should_shadow(policy.shadow):
            decisions.append(self._shadow(req, entry, pair))
        self._record(req, decisions, entry.meta.get("source"))
        return decisions

    def _shadow(self, req: _Request, entry: Entry, pair: tuple[str, str]) -> GateDecision:
        """Re-prefill the member on the mapped prefix and compare next-token distributions over the probe tail."""
        from mappings.metrics import mean_kl

        policy = req.gate.shadow
        assert policy is not None
        end, tail = entry.logits_end, int(entry.tail_logits.shape[0])
        prefix = req.ids[:end]
        ns = self._exact_ns(req.info)
        base, base_len = self.pool.longest_prefix(ns, prefix, pin=True)
        if base is not None:
            req.pinned.append(base)
        exact, _ = self._exact_entry(req, ns, base, base_len if base_len < end else 0, ids=prefix)
        if exact.tail_logits is not None and exact.logits_end == end and exact.tail_logits.shape[0] >= tail:
            reference = exact.tail_logits[-tail:]
        else:
            reference = self.executor.run([req.member], _tail_op, exact.cache, list(prefix), end, tail).logits
        kl = mean_kl(reference, entry.tail_logits)
        passed = kl <= policy.max_kl
        opened = self.breaker.record(pair, passed, policy)
        return GateDecision(passed, "shadow", f"shadow KL {kl:.4f} {'<=' if passed else '>'} {policy.max_kl}"
                            + ("; breaker opened" if opened else ""), {"shadow_kl": kl, **self.breaker.stats(pair)})


def _fitted_sinks(mapping: Any) -> int:
    """The leading positions a mapping was fitted to have exact (its method's ``exact_sinks``; 0 if unknown)."""
    method = getattr(getattr(mapping, "manifest", None), "method", None)
    return int(getattr(method, "exact_sinks", 0) or 0)


def _why(exc: BaseException) -> str:
    """An exception as a reason: the project's typed errors by message, anything else with its type."""
    from mappings.errors import MappingError

    if isinstance(exc, (OrchestraError, MappingError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _ladder_note(summary: dict[str, Any] | None) -> str:
    """What an adaptive repair tried before its cache was refused, for the fallback reason ('' for none)."""
    ladder = (summary or {}).get("ladder")
    if not ladder or ladder.get("passed") is not None:  # no ladder, or it passed and another gate refused
        return ""
    tried = [f"{s['budget']:.0%}" for s in ladder["steps"] if not s.get("skipped")]
    why = f" ({ladder['stopped']})" if ladder.get("stopped") else ""
    return (f"; repair ladder tried {', '.join(tried)} without a pass{why}, spending {ladder['spent']:.1%} of a "
            f"prefill ({ladder['recomputed']} positions recomputed)")


def _tensor(ids: Sequence[int]) -> Any:
    import torch

    return torch.tensor(list(ids), dtype=torch.long)


# Ops are module-level so a remote executor can ship them; they take the held models first.
def _compute_op(model, ids, base, start, keep, base_hidden, want_hidden):
    from orchestra.familycache._ops import compute_tokens

    return compute_tokens(model, ids, base, start, keep, base_hidden, want_hidden)


def _tail_op(model, cache, ids, end, tail):
    from orchestra.familycache._ops import tail_logits

    return tail_logits(model, cache, ids, end, tail)


def _truncate_op(model, cache, length):
    from orchestra.familycache._ops import truncate

    return truncate(model, cache, length)


def _map_op(source, target, mapping, src_cache, ids, tail, repair, hidden, sinks=0, costs=None):
    from orchestra.familycache._ops import map_into

    return map_into(source, target, mapping, src_cache, ids, tail, repair, _cut_hidden(hidden, len(ids)), sinks=sinks,
                    costs=costs)


def _map_target_op(target, mapping, src_cache, ids, tail, repair, hidden, importance=None, probe=None, sinks=0,
                   costs=None):
    from orchestra.familycache._ops import map_into

    return map_into(None, target, mapping, src_cache, ids, tail, repair, _cut_hidden(hidden, len(ids)),
                    importance=importance, probe=probe, sinks=sinks, costs=costs)


def _costs_op(target, directory):
    from orchestra.familycache._ops import pass_costs

    return pass_costs(target, directory)


def _importance_op(source, cache, ids, probe_tokens):
    from orchestra.familycache._ops import source_importance

    return source_importance(source, cache, ids, probe_tokens)


def _cut_hidden(hidden, length):
    """The source's hidden states of the first `length` positions (views), or None."""
    return {i: h[:, :length] for i, h in hidden.items()} if hidden is not None else None


def _mapping_op(source, target, store, cancel=None):
    return store.get(source, target, cancel=cancel)


def _reference_op(source, target, store, mapping, tail):
    return store.probe_reference(source, target, mapping, tail)
