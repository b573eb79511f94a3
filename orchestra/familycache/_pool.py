"""Entries of a FamilyCache: a block-hash prefix index per namespace, a byte budget, pins and LRU order.

Pure bookkeeping (no torch): the tensors an entry holds are measured by the caller. A namespace is
everything a cache's tensors depend on besides its tokens (model fingerprint, dtype, RoPE, and for
mapped caches the source, the mapping and its version, the probe tail and the repair policy), so
an exact request can never see a mapped cache and a stale mapping never serves a hit.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from mappings.types import Tensor
    from orchestra.familycache._handles import CacheRef, HiddenRef
    from orchestra.familycache._records import MappedFrom

__all__ = ["Namespace", "Entry", "EntryPool", "PoolStats", "common_prefix", "token_hash"]


def token_hash(token_ids: Sequence[int]) -> str:
    """sha256 of the token ids (not the text: the same text under another tokenizer is another key)."""
    return hashlib.sha256(json.dumps(list(map(int, token_ids))).encode()).hexdigest()


@dataclass(frozen=True)
class Namespace:
    """Everything a cache's tensors depend on besides the tokens."""

    kind: Literal["exact", "mapped"]
    member_fingerprint: str
    """Combined fingerprint (config + weights + tokenizer) of the model the cache is for."""
    dtype: str
    """Runtime dtype of the cache tensors."""
    rope: str
    """Canonical JSON of the model's RoPE parameters."""
    source_fingerprint: str | None = None
    """Mapped caches: the model whose prefill was mapped."""
    mapping_id: str | None = None
    """Mapped caches: content hash of the mapping's tensors."""
    mapping_version: int | None = None
    """Mapped caches: the mapping format version."""
    variant: str = ""
    """Mapped caches: the probe tail and repair policy that shaped the tensors."""

    def __post_init__(self) -> None:
        mapped = (self.source_fingerprint, self.mapping_id, self.mapping_version)
        if self.kind == "mapped" and any(f is None for f in mapped):
            raise ValueError("a mapped namespace needs source_fingerprint, mapping_id and mapping_version")
        if self.kind == "exact" and (any(f is not None for f in mapped) or self.variant):
            raise ValueError("an exact namespace cannot name a mapping")


@dataclass
class Entry:
    """A cache of `tokens` on one member, with what was measured while building it."""

    namespace: Namespace
    member: str
    tokens: tuple[int, ...]
    cache: CacheRef
    """The cache as the executor handed it out (a remote executor's is a handle)."""
    nbytes: int
    tail_logits: Tensor | None = None
    """Logits of positions [logits_end - len, logits_end) (probe and shadow gates read them)."""
    logits_end: int = 0
    hidden: HiddenRef | None = None
    """Hidden states entering each layer (kept for layer repair of maps from this entry)."""
    mapped: MappedFrom | None = None
    """For a mapped entry: its source, mapping, probe reading and repair (None for an exact one)."""
    seconds: float = 0.0
    """Seconds its build computed (or mapped) for."""
    id: int = 0
    pins: int = 0
    stored: bool = False
    held_outside: bool = False
    on_disk: bool = False
    """Read from, or already written to, the disk tier (never written again)."""
    """Not stored (no room) but pinned by a lease: its bytes count against the budget until the last unpin."""


@dataclass
class PoolStats:
    """Counters over the cache's life."""

    hits: int = 0
    """Requests served entirely from a cached prefix (no compute on the member)."""
    misses: int = 0
    """Requests that had to compute or map something, or waited for an identical build."""
    joins: int = 0
    """Requests that waited for a build in flight (of their tokens, or of a longer prefix to extend or map)."""
    waiting: int = 0
    """Requests waiting for a build in flight right now (a gauge, not a counter)."""
    evictions: int = 0
    evicted_bytes: int = 0
    rejected: int = 0
    """Builds not kept because pinned entries left no room in the budget."""
    reserved_bytes: int = 0
    """Budget held right now for working memory (decoding batches' K/V), not for entries (a gauge)."""
    reservations_refused: int = 0
    """Reservations refused because pinned entries and other reservations left no room."""

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class EntryPool:
    """Entries under a byte budget; finds the longest cached prefix of a token sequence; thread-safe.

    Each stored entry registers the chained hash of every full block of its tokens, so the longest
    shared prefix is found block by block (as vLLM and SGLang index their per-model caches) and
    then extended token by token inside the entry. Pinned entries (leased) are never evicted;
    the budget evicts the least recently used unpinned entries first.
    """

    def __init__(self, budget_bytes: int, block_tokens: int = 16) -> None:
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._blocks: dict[tuple[Namespace, int], set[int]] = {}
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._used = 0
        self._reserved = 0
        self._outside = 0
        self._listeners: list[Callable[[], None]] = []
        self.stats = PoolStats()

    def on_free(self, listener: Callable[[], None]) -> None:
        """Call `listener` (no arguments; in the freeing thread, outside the pool's lock) whenever budget may
        have come free: a reservation or hold given back, an entry unpinned. Whoever waits for room re-checks."""
        with self._lock:
            self._listeners.append(listener)

    def _freed(self) -> None:
        for listener in list(self._listeners):
            listener()

    # -- queries ----------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def outside_bytes(self) -> int:
        """Bytes of entries leases hold that the pool could not store (no room): real memory, counted too."""
        return self._outside

    @property
    def reserved_bytes(self) -> int:
        """Budget held for working memory (`reserve`), besides the entries' `used_bytes`."""
        return self._reserved

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.pins)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def _chain(self, tokens: Sequence[int]) -> list[int]:
        out, h, b = [], 0, self.block_tokens
        for start in range(0, len(tokens) - b + 1, b):
            h = hash((h, tuple(tokens[start : start + b])))
            out.append(h)
        return out

    def longest_prefix(self, namespace: Namespace, tokens: Sequence[int], *, pin: bool = False) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `tokens` in `namespace`, and that length (pinned on request)."""
        with self._lock:
            best: Entry | None = None
            best_len = 0
            candidates: set[int] = set()
            for i, h in enumerate(self._chain(tokens)):
                found = self._blocks.get((namespace, h))
                if not found:
                    break
                candidates = found
                depth = (i + 1) * self.block_tokens
                if depth > best_len:
                    best_len = depth
            # short sequences and the first partial block: any entry in the namespace may match token-wise
            pool = candidates or {e.id for e in self._entries.values() if e.namespace == namespace}
            matched = 0
            for entry_id in pool:
                entry = self._entries.get(entry_id)
                if entry is None:
                    continue
                n = common_prefix(entry.tokens, tokens)  # verifies the block hashes too
                if n > matched or (n == matched and best is not None and entry.id > best.id):
                    best, matched = entry, n
            if best is None or matched == 0:
                return None, 0
            self._entries.move_to_end(best.id)
            if pin:
                best.pins += 1
            return best, matched

    @contextmanager
    def held_still(self) -> Iterator[None]:
        """Hold the pool still (no add, eviction or pin elsewhere) while a route is planned and its entries pinned."""
        with self._lock:
            yield

    def namespaces_for(self, member_fingerprint: str) -> set[Namespace]:
        with self._lock:
            return {e.namespace for e in self._entries.values() if e.namespace.member_fingerprint == member_fingerprint}

    # -- changes ----------------------------------------------------------------------------
    def add(self, entry: Entry, *, pin: bool = True, held: int = 0) -> list[Entry]:
        """Store `entry` (pinned by default), evicting LRU unpinned entries; returns what was evicted.

        When the pinned entries leave no room, the entry is not stored (`entry.stored` stays False)
        and the caller's lease owns it alone. `held`: bytes `hold` counted while it was built, given back
        in the same step (no reservation can take them in between).
        """
        evicted = self._add(entry, pin=pin, held=held)
        if held:  # a build's working memory is free now, beside its entry
            self._freed()
        return evicted

    def _add(self, entry: Entry, *, pin: bool, held: int) -> list[Entry]:
        with self._lock:
            self._reserved = max(0, self._reserved - held)
            self.stats.reserved_bytes = self._reserved
            entry.id = next(self._ids)
            if pin:
                entry.pins += 1
            evicted: list[Entry] = []
            if not self._make_room(entry.nbytes, evicted):
                self.stats.rejected += 1
                if entry.pins:
                    entry.held_outside = True
                    self._outside += entry.nbytes
                return evicted
            self._entries[entry.id] = entry
            self._used += entry.nbytes
            for h in self._chain(entry.tokens):
                self._blocks.setdefault((entry.namespace, h), set()).add(entry.id)
            entry.stored = True
            return evicted

    def _make_room(self, nbytes: int, evicted: list[Entry]) -> bool:
        """Evict LRU unpinned entries until `nbytes` more fit beside the entries and reservations; False (nothing
        evicted) when even evicting every unpinned entry would not make room."""
        evictable = sum(e.nbytes for e in self._entries.values() if not e.pins)
        if self._used - evictable + self._outside + self._reserved + nbytes > self.budget_bytes:
            return False
        evicted += self._evict_lru(nbytes)
        return True

    def _evict_lru(self, nbytes: int) -> list[Entry]:
        """Evict unpinned entries, least recently used first, until `nbytes` more fit (or none is left)."""
        evicted: list[Entry] = []
        for victim in [e for e in self._entries.values() if not e.pins]:
            if self._used + self._outside + self._reserved + nbytes <= self.budget_bytes:
                break
            self._remove(victim)
            evicted.append(victim)
            self.stats.evictions += 1
            self.stats.evicted_bytes += victim.nbytes
        return evicted

    def reserve(self, nbytes: int) -> bool:
        """Hold `nbytes` of the budget for working memory (a decoding row's K/V), evicting LRU unpinned entries
        to make room; False (nothing held) when pinned entries and other reservations leave too little."""
        with self._lock:
            if nbytes <= 0:
                return True
            if not self._make_room(nbytes, []):
                self.stats.reservations_refused += 1
                return False
            self._reserved += nbytes
            self.stats.reserved_bytes = self._reserved
            return True

    def hold(self, nbytes: int) -> None:
        """Count `nbytes` of work in progress (a cache being built) against the budget, whether or not they fit:
        the memory is being used either way. Evicts LRU unpinned entries to make what room it can, so that
        reservations (`reserve`) see less room while the build runs. Give it back with `release`."""
        with self._lock:
            if nbytes <= 0:
                return
            self._evict_lru(nbytes)
            self._reserved += nbytes
            self.stats.reserved_bytes = self._reserved

    def release(self, nbytes: int) -> None:
        """Give back `nbytes` held by `reserve` or `hold`."""
        with self._lock:
            self._reserved = max(0, self._reserved - nbytes)
            self.stats.reserved_bytes = self._reserved
        self._freed()

    def pin(self, entry: Entry) -> None:
        with self._lock:
            entry.pins += 1

    def unpin(self, entry: Entry) -> list[Entry]:
        """Release one pin; an over-budget pool then evicts what it can. Returns what was evicted."""
        with self._lock:
            entry.pins = max(0, entry.pins - 1)
            if entry.held_outside and not entry.pins:
                entry.held_outside = False
                self._outside -= entry.nbytes
            evicted = self._evict_lru(0)
        self._freed()
        return evicted

    def _remove(self, entry: Entry) -> None:
        self._entries.pop(entry.id, None)
        self._used -= entry.nbytes
        entry.stored = False
        for h in self._chain(entry.tokens):
            ids = self._blocks.get((entry.namespace, h))
            if ids is not None:
                ids.discard(entry.id)
                if not ids:
                    del self._blocks[(entry.namespace, h)]

    def clear(self) -> None:
        """Drop every unpinned entry."""
        with self._lock:
            for entry in [e for e in self._entries.values() if not e.pins]:
                self._remove(entry)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
