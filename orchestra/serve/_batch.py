"""Step-level continuous batching: the requests decoding on one member share one forward pass per step.

A request joins by running its own prompt tail over a private copy of its prefix cache (so its first
token comes as soon as that pass ends), then its K/V rows are merged into the member's batch:
caches of different lengths are left-padded to a common length and masked, each row keeps its own
positions, so every row sees exactly what it would alone. Memory: the prefix is copied once, into a
buffer with room for the tail (`RoomLayer`), and once more into the batch's buffers, which have room
for the decoded tokens; nothing is concatenated per step. Each step feeds every row's last token
in one pass; finished or cancelled rows leave at once and a waiting request joins at the next step.
Token choice, stop strings, constraints and streaming text are each row's own `TokenStream`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

from agents.bridge import start_thread

if TYPE_CHECKING:
    import torch
    from transformers.cache_utils import DynamicCache

    from agents.continuation import Continuation, TokenStream
    from mappings.types import KVCache
    from orchestra.models.registry import LoadedModel

__all__ = ["BatchDecoder", "WorkingMemory", "batchable", "RowMemory"]

PASS_MEMORY_FACTOR = 3.0
"""Activations of a forward pass over new tokens, in multiples of their K/V (beside what attending to the prefix
takes: `BatchDecoder.row_memory`)."""


class WorkingMemory(Protocol):
    """A byte budget the decoder's rows are held against (the FamilyCache's pool: rows and entries share it)."""

    def reserve(self, nbytes: int) -> bool:
        """Hold `nbytes`, making room if the budget can; False (nothing held) when it cannot."""

    def hold(self, nbytes: int) -> None:
        """Count `nbytes` in use whether or not they fit (a row that must decode although the budget is full)."""

    def release(self, nbytes: int) -> None:
        """Give back `nbytes` held by `reserve` or `hold`."""

    @property
    def reserved_bytes(self) -> int:
        """Bytes held now by reservations and builds (every member's): 0 when nothing decodes or builds."""

    def on_free(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever budget may have come free (a release, an unpin)."""


def batchable(cache: object) -> bool:
    """Only plain full-attention layers can be padded and merged (sliding windows or quantized caches cannot)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - transformers without per-layer caches
        return False
    layers = getattr(cache, "layers", None)
    if not layers:
        return False
    return all(type(layer) is DynamicLayer for layer in layers)


@dataclass
class _Job:
    prefix_cache: KVCache | None
    prefix_len: int
    new_ids: list[int]
    stream: TokenStream
    cancel: threading.Event
    done: threading.Event = field(default_factory=threading.Event)
    result: Continuation | None = None
    error: BaseException | None = None
    length: int = 0
    token: int = 0
    started: float = 0.0
    prompt_s: float = 0.0
    decode_started: float = 0.0
    reserved: int = 0
    """Bytes of the working-memory budget this row holds until it leaves the batch."""
    joining: int = 0
    """Of `reserved`, the bytes only its join needs (the tail's pass, the copy into the batch): given back once
    it has merged."""


@dataclass(frozen=True)
class RowMemory:
    """What a decoding row holds against the budget, in bytes."""

    kv: int
    """Its K/V in the batch (prompt and a chunk of reply, as wide as the batch), plus one layer of it: the batch
    copies one layer at a time when rows leave or it grows."""
    join: int
    """Beside that, while it joins: the working memory of its prompt tail's forward pass (the keys and values
    repeated to every query head, the activations) or of the copy of one batch layer that takes it in,
    whichever is larger."""

    @property
    def total(self) -> int:
        return self.kv + self.join


class BatchDecoder:
    """One member's decoding loop, in a thread of its own; `decode` blocks the caller until its reply is done."""

    def __init__(self, model: LoadedModel, lock: threading.Lock, *, max_batch: int = 8,
                 memory: WorkingMemory | None = None) -> None:
        self.model = model
        self.lock = lock
        self.max_batch = max_batch
        self.memory = memory
        """Rows join only while their K/V fit this budget; a row that does not fit waits for room, unless nothing
        holds any (no row decodes and nothing builds, on any member): then it joins alone, so replies never stall."""
        self.over_budget_rows = 0
        """Rows admitted alone although the budget had no room for them (nothing else held any)."""
        self._stalled = False
        """The first waiting row found no room and nothing here decodes: sleep until the budget frees some."""
        self._waiting: list[_Job] = []
        self._rows: list[_Job] = []
        self._mask: torch.Tensor | None = None
        self._cache: DynamicCache | None = None
        """The batch's cache: `RoomLayer`s with a row per job (a step writes its token in place)."""
        self._cv = threading.Condition()
        if memory is not None:
            memory.on_free(self._room_freed)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0
        """Batched forward passes run (for metrics and tests)."""
        self.rows_stepped = 0
        """Sum over steps of the rows in each: rows_stepped / steps is the mean batch size."""

    def decode(self, prefix_cache: KVCache, prefix_len: int, new_ids: list[int], stream: TokenStream,
               cancel: threading.Event) -> Continuation:
        job = _Job(prefix_cache, prefix_len, list(new_ids), stream, cancel, started=time.perf_counter())
        with self._cv:
            if self._closed:
                raise RuntimeError("the decoder is closed")
            self._waiting.append(job)
            if self._thread is None:
                self._thread = start_thread(self._loop, name=f"batch-{self.model.info.alias}")
            self._cv.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _room_freed(self) -> None:
        with self._cv:
            if self._stalled:
                self._stalled = False
                self._cv.notify()

    # -- the loop (decoder thread) ----------------------------------------------------------------
    def _loop(self) -> None:
        import torch

        while True:
            with self._cv:
                while not self._rows and not self._closed and (not self._waiting or self._stalled):
                    # a stalled row is woken by freed budget; the timeout only looks for cancelled waiting rows
                    self._cv.wait(timeout=1.0 if self._stalled else None)
                    if self._stalled and any(job.cancel.is_set() for job in self._waiting):
                        break
                if self._closed and not self._waiting and not self._rows:
                    return
                joining = self._admit()
                self._stalled = bool(self._waiting) and not joining and not self._rows
            try:
                with torch.no_grad():
                    for job in joining:
                        self._join(job)
                    if self._rows:
                        self._step()
            except BaseException as exc:  # a model error ends every row in this batch, never the server
                for job in [*joining, *self._rows]:
                    if not job.done.is_set():
                        self._fail(job, exc)
                self._reset()

    def _admit(self) -> list[_Job]:
        """The waiting jobs that join now (called with `_cv` held): as many as the batch has rows for and, in
        arrival order, the memory budget has room for; when nothing holds any of it (no row, no build, on any
        member), the first joins regardless."""
        cancelled = [job for job in self._waiting if job.cancel.is_set()]
        if cancelled:  # gone before they joined: they hold nothing, and must not wait for room they no longer need
            self._waiting = [job for job in self._waiting if not job.cancel.is_set()]
            for job in cancelled:
                self._finish(job, cancelled=True)
        room = max(0, self.max_batch - len(self._rows))
        joining: list[_Job] = []
        for job in self._waiting[:room]:
            need = self.row_memory(job, len(self._rows) + len(joining) + 1)
            if self.memory is None or self.memory.reserve(need.total):
                job.reserved, job.joining = (need.total, need.join) if self.memory is not None else (0, 0)
            elif self._rows or joining or (self.memory.reserved_bytes > 0 and not self._closed):
                break  # it waits for a row (here or on another member) or a build to give its bytes back
            else:  # counted all the same: while it decodes, no other member's row may join over the budget too
                self.memory.hold(need.total)
                job.reserved, job.joining = need.total, need.join
                self.over_budget_rows += 1
            joining.append(job)
        self._waiting = self._waiting[len(joining):]
        return joining

    @functools.cached_property
    def _layout(self) -> tuple[int, int, int, int]:
        """The model's K/V bytes per token, layers, query heads, and query heads per K/V head (read once)."""
        from mappings.cache_io import model_dtype
        from mappings.capture import kv_shape, kv_token_bytes, query_groups

        config = self.model.model.config
        shape, groups = kv_shape(config), query_groups(config)
        element = model_dtype(self.model.model).itemsize  # the K/V's dtype, not a quantized weight's
        return kv_token_bytes(config, element), shape.num_layers, shape.kv_heads * groups, groups

    def row_memory(self, job: _Job, rows: int) -> RowMemory:
        """What `job` holds once it decodes in a batch of `rows` rows, and beside that while it joins."""
        from orchestra.serve._room import ROOM_CHUNK

        per_token, layers, heads, groups = self._layout
        width = max(job.prefix_len + len(job.new_ids), self._mask.shape[1] if self._mask is not None else 0)
        row = per_token * (width + ROOM_CHUNK)
        tail = len(job.new_ids)
        # one layer's keys and values repeated to every query head, the layer's attention scores (float32),
        # and the activations of the new tokens (build_memory --ops join: 11, 16 and 34 MiB for 64 tokens over
        # 1k, 2k and 4k; this gives 16, 22 and 36)
        tail_pass = row * groups // layers + heads * tail * width * 4 + int(PASS_MEMORY_FACTOR * per_token * tail)
        batch_layer = row * rows // layers
        return RowMemory(kv=row + row // layers, join=max(tail_pass, batch_layer))

    def _joined(self, job: _Job) -> None:
        """`job` is in the batch: what only its join needed goes back to the budget."""
        if job.joining and self.memory is not None:
            self.memory.release(job.joining)
            job.reserved -= job.joining
        job.joining = 0

    def _give_back(self, job: _Job) -> None:
        if job.reserved and self.memory is not None:
            self.memory.release(job.reserved)
        job.reserved = job.joining = 0

    def _finish(self, job: _Job, *, cancelled: bool = False) -> None:
        self._give_back(job)
        now = time.perf_counter()
        job.result = job.stream.result(len(job.new_ids), job.prompt_s, now - job.decode_started, cancelled=cancelled)
        job.done.set()

    def _fail(self, job: _Job, exc: BaseException) -> None:
        self._give_back(job)
        job.error = exc
        job.done.set()

    def _join(self, job: _Job) -> None:
        """The job's prompt tail over its own copy of the prefix, its first token, then its rows into the batch."""
        from agents.kv import forward_tokens
        from mappings.cache_io import cache_layers, model_device, model_dtype, new_cache, sync_device
        from orchestra.serve._room import ROOM_CHUNK, room_cache

        if job.cancel.is_set():
            return self._finish(job, cancelled=True)
        model = self.model.model
        t0 = time.perf_counter()
        try:  # everything up to here is this request's alone: its failure is its own, never the batch's
            cache: DynamicCache
            if job.prefix_cache is not None and job.prefix_len:
                # one copy of the prefix, with room for the tail: the tail's pass writes in place
                cache = room_cache(cache_layers(job.prefix_cache), len(job.new_ids) + ROOM_CHUNK,
                                   dtype=model_dtype(model), device=model_device(model))
                job.prefix_cache = None  # copied: the row must not keep the lease's cache alive after it is released
            else:
                cache = cast("DynamicCache", new_cache(model))
            with self.lock:
                logits = forward_tokens(model, job.new_ids, cache, job.prefix_len)
                sync_device(self.model.device)
            job.prompt_s = time.perf_counter() - t0
            job.decode_started = time.perf_counter()
            job.token = job.stream.push(logits)
        except Exception as exc:
            return self._fail(job, exc)
        job.length = job.prefix_len + len(job.new_ids)
        if job.stream.finish is not None:
            return self._finish(job)
        self._merge(job, cache)
        self._joined(job)

    def _merge(self, job: _Job, cache: DynamicCache) -> None:
        import torch

        from mappings.cache_io import cache_layers
        from orchestra.serve._room import RoomLayer, add_row

        length = job.length
        ones = torch.ones(1, length, dtype=torch.long, device=self.model.device)
        if not self._rows:  # the first row: its own cache is the batch's (no copy when it already has room)
            if not all(isinstance(layer, RoomLayer) for layer in cache.layers):
                cache = add_row(None, cache_layers(cache))
            self._cache, self._mask, self._rows = cache, ones, [job]
            return
        assert self._mask is not None
        width = max(self._mask.shape[1], length)
        layers = cache_layers(cache)
        cache.layers = []  # the batch takes each layer in turn: the joining copy is freed as it goes, not at the end
        del cache
        self._cache = add_row(self._cache, layers)
        old = self._mask.new_zeros(self._mask.shape[0], width)
        old[:, width - self._mask.shape[1]:] = self._mask
        row = ones.new_zeros(1, width)
        row[:, width - length:] = 1
        self._mask = torch.cat([old, row], 0)
        self._rows.append(job)

    def _step(self) -> None:
        """One forward pass for every row; rows that finish (or were cancelled) leave the batch."""
        import torch

        from mappings.cache_io import forward_with_cache, sync_device

        live = [i for i, job in enumerate(self._rows) if not job.cancel.is_set()]
        if len(live) < len(self._rows):
            for i, job in enumerate(self._rows):
                if i not in live:
                    self._finish(job, cancelled=True)
            self._keep(live)
            if not self._rows:
                return
        assert self._mask is not None and self._cache is not None
        device = self._mask.device
        tokens = torch.tensor([[job.token] for job in self._rows], dtype=torch.long, device=device)
        positions = torch.tensor([[job.length] for job in self._rows], dtype=torch.long, device=device)
        mask = torch.cat([self._mask, self._mask.new_ones(len(self._rows), 1)], 1)
        with self.lock:
            logits, _, _ = forward_with_cache(self.model.model, tokens, self._cache, attention_mask=mask,
                                              position_ids=positions, logits_to_keep=1)
            sync_device(self.model.device)
        self.steps += 1
        self.rows_stepped += len(self._rows)
        self._mask = mask
        keep = []
        for i, job in enumerate(self._rows):
            job.length += 1
            try:  # token choice (sampler, constraint, stop strings) is the row's own: a failure ends that row only
                job.token = job.stream.push(logits[i, -1].float())
            except Exception as exc:
                self._fail(job, exc)
                continue
            if job.stream.finish is not None:
                self._finish(job)
            else:
                keep.append(i)
        if len(keep) < len(self._rows):
            self._keep(keep)

    def _keep(self, rows: list[int]) -> None:
        """Only these rows stay; columns no remaining row uses (left padding) are dropped."""
        from orchestra.serve._room import RoomLayer

        if not rows:
            self._reset()
            return
        assert self._mask is not None and self._cache is not None
        index = self._mask.new_tensor(rows)
        self._mask = self._mask.index_select(0, index)
        self._rows = [self._rows[i] for i in rows]
        used = self._mask.any(0).nonzero()
        first = int(used[0]) if used.numel() else 0
        for layer in self._cache.layers:
            assert isinstance(layer, RoomLayer)
            layer.batch_select_indices(index)
            layer.drop_front(first)
        self._mask = self._mask[:, first:]

    def _reset(self) -> None:
        self._rows, self._mask, self._cache = [], None, None
