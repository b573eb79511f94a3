"""Document KV caches, keyed as the seed's section 5.3 asks, with exact and mapped kept apart.

A cache is only valid for the exact model (weights, dtype, RoPE) and the exact tokens that made
it, and a mapped cache additionally for the mapping that produced it. Exact and mapped (lossy)
caches live in separate namespaces: asking for an exact cache can never return a mapped one.
Memory is bounded by a byte budget with least-recently-used eviction.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CacheKey", "KVStore", "StoreStats", "token_hash"]

Namespace = Literal["exact", "mapped"]


def token_hash(token_ids: Sequence[int]) -> str:
    """sha256 of the token ids (not the text: the same text under another tokenizer is another key)."""
    return hashlib.sha256(json.dumps(list(map(int, token_ids))).encode()).hexdigest()


@dataclass(frozen=True)
class CacheKey:
    """Everything a document cache depends on."""

    namespace: Namespace
    model_fingerprint: str
    """Combined fingerprint (config + weights + tokenizer) of the model the cache is for."""
    dtype: str
    """Runtime dtype of the cache tensors, e.g. ``float32``."""
    rope: str
    """Canonical JSON of the target's RoPE parameters (type, base, scaling)."""
    token_hash: str
    """sha256 of the document's token ids."""
    source_fingerprint: str | None = None
    """For mapped caches: the model whose prefill was mapped."""
    mapping_id: str | None = None
    """For mapped caches: content hash of the mapping's tensors."""
    mapping_version: int | None = None
    """For mapped caches: the mapping format version."""
    variant: str = ""
    """Anything else that changes the tensors (e.g. ``tail=64`` for tail-recomputed caches)."""

    def __post_init__(self) -> None:
        mapped_fields = (self.source_fingerprint, self.mapping_id, self.mapping_version)
        if self.namespace == "mapped" and any(f is None for f in mapped_fields):
            raise ValueError("a mapped cache key needs source_fingerprint, mapping_id and mapping_version")
        if self.namespace == "exact" and any(f is not None for f in mapped_fields):
            raise ValueError("an exact cache key cannot name a mapping")


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class _Entry:
    value: Any
    nbytes: int
    meta: dict[str, Any] = field(default_factory=dict)


def cache_nbytes(cache: Any) -> int:
    """Bytes held by the K/V tensors of a cache (DynamicCache, legacy tuples, or lists of pairs)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        pairs = [(layer.keys, layer.values) for layer in layers]
    else:
        pairs = list(cache)
    return sum(int(t.numel() * t.element_size()) for pair in pairs for t in pair[:2] if t is not None)


class KVStore:
    """A byte-bounded LRU store of document caches; thread-safe."""

    def __init__(self, budget_bytes: int = 4 << 30) -> None:
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = StoreStats()

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def get(self, key: CacheKey, *, namespace: Namespace) -> Any | None:
        """Return the cache for `key` or None; `namespace` must match the key's (exact never sees mapped)."""
        if key.namespace != namespace:
            raise ValueError(f"asked the {namespace} namespace with a {key.namespace} key")
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return entry.value

    def meta(self, key: CacheKey) -> dict[str, Any]:
        with self._lock:
            entry = self._entries.get(key)
            return dict(entry.meta) if entry else {}

    def put(self, key: CacheKey, cache: Any, *, nbytes: int | None = None, **meta: Any) -> bool:
        """Store a cache; evicts least-recently-used entries; returns False if it alone exceeds the budget."""
        size = cache_nbytes(cache) if nbytes is None else nbytes
        with self._lock:
            if size > self.budget_bytes:
                self.stats.rejected += 1
                return False
            self._entries.pop(key, None)
            while self._entries and self.used_bytes + size > self.budget_bytes:
                self._entries.popitem(last=False)
                self.stats.evictions += 1
            self._entries[key] = _Entry(cache, size, meta)
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
