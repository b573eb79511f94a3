"""The disk tier of a FamilyCache: a document's K/V outlives the process that prefilled it.

One safetensors file per entry, ``<dir>/<namespace key>/<token hash>.safetensors``: the K/V of every
layer, the kept tail logits, and in the header's metadata what the entry is (its namespace: model
fingerprint, dtype, RoPE, and for a mapped entry the source, mapping id and version and the probe/repair
variant; its tokens; how it was mapped and what its probe read). A later process finds an entry by the
namespace its own member computes, so an exact request never sees a mapped entry, and a mapped entry of a
mapping that changed is never found (and is dropped when seen). The tensors' sha256 is in the header:
a corrupt or truncated file is detected on load, deleted and recomputed, never served.

Writes happen behind the caller (one writer thread) to a temporary sibling renamed into place under a
file lock, so two processes sharing a store never see a torn entry. An entry whose tokens add fewer than
``min_new_tokens`` to a prefix already stored is not written (the stored prefix serves it, the rest is
computed). The byte budget evicts the least recently used files (a load touches its file). A store that
cannot be written (read-only or full disk) warns once and keeps serving what it can read.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from agents.bridge import start_thread
from orchestra._logging import get_logger
from orchestra.familycache._pool import Namespace, common_prefix, token_hash

if TYPE_CHECKING:
    from mappings.types import Tensor

__all__ = ["KVStore", "StoredEntry", "LoadedEntry", "DiskStats", "FORMAT_VERSION", "namespace_key"]

FORMAT_VERSION = 1
_META_KEY = "orchestra.kv"
_SUFFIX = ".safetensors"
_STALE_TMP_SECONDS = 3600.0

log = get_logger("orchestra.kvstore")


def namespace_key(namespace: Namespace) -> str:
    """A short stable key of a namespace (its folder name)."""
    return hashlib.sha256(json.dumps(asdict(namespace), sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class StoredEntry:
    """What the index knows of one file without reading its tensors."""

    path: Path
    namespace: Namespace
    member: str
    """The member name of the process that wrote it (a later process matches by fingerprint, not name)."""
    tokens: tuple[int, ...]
    nbytes: int
    """Size of the file."""
    mtime: float
    """Last write or load (the LRU order)."""

    @property
    def key(self) -> str:
        return f"{self.path.parent.name}/{self.path.stem}"


@dataclass
class LoadedEntry:
    """An entry's tensors and record, checked against its hash."""

    layers: list[tuple[Tensor, Tensor]]
    tail_logits: Tensor | None
    logits_end: int
    seconds: float
    """Seconds its original build computed for (what loading it saves)."""
    mapped: dict[str, object] | None
    """The mapped entry's record (`MappedFrom` as JSON); None for an exact entry."""


@dataclass
class DiskStats:
    """Counters since the store was opened in this process."""

    loads: int = 0
    load_seconds: float = 0.0
    load_bytes: int = 0
    writes: int = 0
    write_seconds: float = 0.0
    write_bytes: int = 0
    skipped: int = 0
    """Entries not written: a stored prefix already holds all but a few of their tokens."""
    corrupt: int = 0
    """Files that failed their hash or could not be parsed (deleted, recomputed)."""
    evictions: int = 0
    write_errors: int = 0


@dataclass
class _Pending:
    namespace: Namespace
    member: str
    tokens: tuple[int, ...]
    layers: list[tuple[Tensor, Tensor]]
    tail_logits: Tensor | None
    logits_end: int
    seconds: float
    mapped: dict[str, object] | None
    done: threading.Event = field(default_factory=threading.Event)


class KVStore:
    """KV caches on disk under a byte budget, shared by every process that opens the same folder; thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], budget_bytes: int = 8 << 30, *, min_tokens: int = 64,
                 min_new_tokens: int = 256) -> None:
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        self.directory = Path(directory).expanduser()
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        """Entries shorter than this are neither written nor loaded (recomputing them is cheaper)."""
        self.min_new_tokens = min_new_tokens
        self.stats = DiskStats()
        self.warnings: list[str] = []
        self.writable = True
        self._index: dict[Path, StoredEntry] = {}
        self._lock = threading.RLock()
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            self._disable(f"KV store {self.directory} cannot be written ({exc.strerror or exc}); caches stay in memory")
        _OPEN.add(self)

    # -- reading ------------------------------------------------------------------------------------------------
    def entries(self, namespace: Namespace | None = None) -> list[StoredEntry]:
        """What the store holds (in one namespace, or all), oldest use first."""
        with self._lock:
            self._rescan(namespace)
            found = [e for e in self._index.values() if namespace is None or e.namespace == namespace]
        return sorted(found, key=lambda e: e.mtime)

    def namespaces_for(self, member_fingerprint: str) -> set[Namespace]:
        """Every namespace holding caches for a model with this fingerprint."""
        return {e.namespace for e in self.entries() if e.namespace.member_fingerprint == member_fingerprint}

    def find(self, namespace: Namespace, ids: Sequence[int]) -> tuple[StoredEntry | None, int]:
        """The stored entry sharing the longest prefix with `ids` in `namespace`, and that length."""
        best: StoredEntry | None = None
        best_len = 0
        for entry in self.entries(namespace):
            n = common_prefix(entry.tokens, ids)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    def load(self, stored: StoredEntry) -> LoadedEntry | None:
        """The entry's tensors, or None when its file is gone, truncated or fails its hash (then it is deleted)."""
        from safetensors.torch import load as load_bytes

        t0 = time.perf_counter()
        try:
            data = stored.path.read_bytes()
        except OSError:
            self._forget(stored.path)
            return None
        try:
            tensors = load_bytes(data)
            meta = _header_meta(data)
            record = json.loads(meta[_META_KEY])
            if record.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {record.get('format')} is not {FORMAT_VERSION}")
            if _digest(tensors) != record["digest"]:
                raise ValueError("its tensors do not match their sha256")
            layers = [(tensors[f"k.{i}"], tensors[f"v.{i}"]) for i in range(int(record["layers"]))]
        except Exception as exc:  # any damage: never served, removed so the next build replaces it
            self.stats.corrupt += 1
            log.warning("kv_store_corrupt", path=str(stored.path), error=str(exc))
            self.remove(stored)
            return None
        with contextlib.suppress(OSError):
            os.utime(stored.path)  # most recently used: the last the budget evicts
        self.stats.loads += 1
        self.stats.load_bytes += len(data)
        self.stats.load_seconds += time.perf_counter() - t0
        return LoadedEntry(layers, tensors.get("tail_logits"), int(record["logits_end"]), float(record["seconds"]),
                           record.get("mapped"))

    # -- writing ------------------------------------------------------------------------------------------------
    def put(self, namespace: Namespace, member: str, tokens: Sequence[int], layers: list[tuple[Tensor, Tensor]], *,
            tail_logits: Tensor | None = None, logits_end: int = 0, seconds: float = 0.0,
            mapped: dict[str, object] | None = None) -> threading.Event | None:
        """Write an entry behind the caller (the tensors must not change afterwards); an event set once it is
        written or skipped. None when the store does not take it (read-only, or shorter than `min_tokens`)."""
        if not self.writable or len(tokens) < self.min_tokens:
            return None
        pending = _Pending(namespace, member, tuple(int(t) for t in tokens), list(layers), tail_logits, logits_end,
                           seconds, mapped)
        with self._lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = start_thread(self._write_loop, name="orchestra-kv-writer")
        self._queue.put(pending)
        return pending.done

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk (or skipped); False if `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Finish queued writes and stop the writer."""
        self.flush()
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._writer = None

    def _write_loop(self) -> None:
        while True:
            pending = self._queue.get()
            try:
                if pending is None:
                    return
                self._write(pending)
            except Exception as exc:  # a writer that dies would leave every later put waiting
                self.stats.write_errors += 1
                log.warning("kv_store_write_failed", error=str(exc))
            finally:
                if pending is not None:
                    pending.done.set()
                self._queue.task_done()

    def _write(self, pending: _Pending) -> None:
        if not self.writable:
            return
        from safetensors.torch import save as save_bytes

        for stored in self.entries(pending.namespace):
            shared = common_prefix(stored.tokens, pending.tokens)
            if shared >= self.min_tokens and shared >= len(pending.tokens) - self.min_new_tokens:
                self.stats.skipped += 1
                return
        t0 = time.perf_counter()
        named = [(f"{kind}.{i}", t) for i, pair in enumerate(pending.layers) for kind, t in zip("kv", pair, strict=True)]
        if pending.tail_logits is not None:
            named.append(("tail_logits", pending.tail_logits))
        tensors = _own_storage(named)
        record = {"format": FORMAT_VERSION, "namespace": asdict(pending.namespace), "member": pending.member,
                  "tokens": list(pending.tokens), "layers": len(pending.layers), "logits_end": pending.logits_end,
                  "seconds": pending.seconds, "mapped": pending.mapped, "digest": _digest(tensors),
                  "created": time.time()}
        data = save_bytes(tensors, metadata={_META_KEY: json.dumps(record)})
        folder = self.directory / namespace_key(pending.namespace)
        path = folder / f"{token_hash(pending.tokens)[:32]}{_SUFFIX}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
            with self._file_lock():
                try:
                    with open(tmp, "wb") as fh:
                        fh.write(data)
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.replace(tmp, path)
                finally:
                    with contextlib.suppress(OSError):
                        tmp.unlink()
                self._evict_over_budget(keep=path)
        except OSError as exc:
            self.stats.write_errors += 1
            self._disable(f"KV store {self.directory} cannot be written ({exc.strerror or exc}); "
                          "caches stay in memory from now on")
            return
        self.stats.writes += 1
        self.stats.write_bytes += len(data)
        self.stats.write_seconds += time.perf_counter() - t0
        with self._lock:
            self._index[path] = StoredEntry(path, pending.namespace, pending.member, pending.tokens, len(data),
                                            time.time())

    # -- housekeeping -------------------------------------------------------------------------------------------
    def remove(self, stored: StoredEntry) -> None:
        """Delete one entry (missing already is fine)."""
        with contextlib.suppress(OSError):
            stored.path.unlink()
        self._forget(stored.path)

    def drop_namespace(self, namespace: Namespace) -> int:
        """Delete every entry of a namespace (a mapping that changed); how many were deleted."""
        gone = self.entries(namespace)
        for stored in gone:
            self.remove(stored)
        return len(gone)

    def prune(self, budget_bytes: int | None = None, *, keep: Callable[[StoredEntry], bool] | None = None) -> list[StoredEntry]:
        """Delete entries `keep` refuses, then the least recently used beyond `budget_bytes` (default: the store's)."""
        removed: list[StoredEntry] = []
        with self._file_lock():
            for stored in self.entries():
                if keep is not None and not keep(stored):
                    self.remove(stored)
                    removed.append(stored)
            removed += self._evict_over_budget(budget=budget_bytes)
        return removed

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries())

    def _evict_over_budget(self, *, keep: Path | None = None, budget: int | None = None) -> list[StoredEntry]:
        budget = self.budget_bytes if budget is None else budget
        entries = self.entries()
        used = sum(e.nbytes for e in entries)
        removed = []
        for stored in entries:  # oldest use first
            if used <= budget:
                break
            if stored.path == keep:
                continue
            self.remove(stored)
            used -= stored.nbytes
            removed.append(stored)
            self.stats.evictions += 1
        return removed

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        from filelock import FileLock

        with FileLock(str(self.directory / ".lock")):
            yield

    def _disable(self, why: str) -> None:
        if self.writable:
            self.writable = False
            self.warnings.append(why)
            log.warning("kv_store_read_only", reason=why)

    def _forget(self, path: Path) -> None:
        with self._lock:
            self._index.pop(path, None)

    def _rescan(self, namespace: Namespace | None) -> None:
        """Bring the index up to date with the folder (other processes write and delete too)."""
        if not self.directory.is_dir():
            self._index.clear()
            return
        folders = ([self.directory / namespace_key(namespace)] if namespace is not None
                   else [p for p in self.directory.iterdir() if p.is_dir()])
        seen: set[Path] = set()
        now = time.time()
        for folder in folders:
            try:
                items = list(os.scandir(folder))
            except OSError:
                continue
            for item in items:
                path = Path(item.path)
                if item.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        if now - item.stat().st_mtime > _STALE_TMP_SECONDS:  # a writer killed mid-write
                            path.unlink()
                    continue
                if not item.name.endswith(_SUFFIX):
                    continue
                try:
                    st = item.stat()
                except OSError:
                    continue
                seen.add(path)
                known = self._index.get(path)
                if known is not None and known.nbytes == st.st_size:
                    if known.mtime != st.st_mtime:
                        self._index[path] = StoredEntry(path, known.namespace, known.member, known.tokens,
                                                        known.nbytes, st.st_mtime)
                    continue
                stored = _read_header(path, st.st_size, st.st_mtime)
                if stored is None:
                    self.stats.corrupt += 1
                    with contextlib.suppress(OSError):
                        path.unlink()
                    continue
                self._index[path] = stored
        for path in [p for p in self._index if p.parent in folders and p not in seen]:
            del self._index[path]


def _own_storage(named: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """CPU tensors each owning exactly its storage (safetensors refuses views of one buffer and shared storage:
    a cache's layers may be views of one tensor, or one tensor twice)."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named:
        t = tensor.detach().cpu().contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _digest(tensors: dict[str, Tensor]) -> str:
    """sha256 over the tensors' bytes in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def _header_meta(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta: dict[str, str] = header.get("__metadata__") or {}
    return meta


def _read_header(path: Path, size: int, mtime: float) -> StoredEntry | None:
    """The index record of a file from its header alone (None when the header is unreadable)."""
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or n > size:
                return None
            header = json.loads(fh.read(n))
        record = json.loads(header["__metadata__"][_META_KEY])
        if record.get("format") != FORMAT_VERSION:
            return None
        namespace = Namespace(**record["namespace"])
        return StoredEntry(path, namespace, str(record.get("member", "")), tuple(record["tokens"]), size, mtime)
    except (OSError, ValueError, KeyError, TypeError):
        return None


_OPEN: weakref.WeakSet[KVStore] = weakref.WeakSet()


@atexit.register
def _finish_writes() -> None:
    """Queued writes reach the disk before a process that made them exits normally (bounded: a minute)."""
    for store in list(_OPEN):
        store.flush(timeout=60.0)
