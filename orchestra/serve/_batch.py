"""Step-level continuous batching: the requests decoding on one member share one forward pass per step.

A request joins by running its own prompt tail over a private copy of its prefix cache (so its first
token comes as soon as that pass ends), then its K/V rows are merged into the member's batch:
caches of different lengths are left-padded to a common length and masked, each row keeps its own
positions, so every row sees exactly what it would alone. Each step feeds every row's last token
in one pass; finished or cancelled rows leave at once and a waiting request joins at the next step.
Token choice, stop strings, constraints and streaming text are each row's own `TokenStream`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from agents.continuation import Continuation, TokenStream
    from mappings.types import KVCache
    from orchestra.registry import LoadedModel

__all__ = ["BatchDecoder", "batchable"]


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
    prefix_cache: KVCache
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


class BatchDecoder:
    """One member's decoding loop, in a thread of its own; `decode` blocks the caller until its reply is done."""

    def __init__(self, model: LoadedModel, lock: threading.Lock, *, max_batch: int = 8) -> None:
        self.model = model
        self.lock = lock
        self.max_batch = max_batch
        self._waiting: list[_Job] = []
        self._rows: list[_Job] = []
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._mask: torch.Tensor | None = None
        self._cache: KVCache | None = None
        """The batch's cache while its rows stay the same (its layers have room: a step writes in place)."""
        self._cv = threading.Condition()
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
                self._thread = threading.Thread(target=self._loop, name=f"batch-{self.model.info.alias}", daemon=True)
                self._thread.start()
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

    # -- the loop (decoder thread) ----------------------------------------------------------------
    def _loop(self) -> None:
        import torch

        while True:
            with self._cv:
                while not self._waiting and not self._rows and not self._closed:
                    self._cv.wait()
                if self._closed and not self._waiting and not self._rows:
                    return
                room = max(0, self.max_batch - len(self._rows))
                joining, self._waiting = self._waiting[:room], self._waiting[room:]
            try:
                with torch.no_grad():
                    for job in joining:
                        self._join(job)
                    if self._rows:
                        self._step()
            except BaseException as exc:  # a model error ends every row in this batch, never the server
                for job in [*joining, *self._rows]:
                    if not job.done.is_set():
                        job.error = exc
                        job.done.set()
                self._reset()

    def _finish(self, job: _Job, *, cancelled: bool = False) -> None:
        now = time.perf_counter()
        job.result = job.stream.result(len(job.new_ids), job.prompt_s, now - job.decode_started, cancelled=cancelled)
        job.done.set()

    def _fail(self, job: _Job, exc: BaseException) -> None:
        job.error = exc
        job.done.set()

    def _join(self, job: _Job) -> None:
        """The job's prompt tail over its own copy of the prefix, its first token, then its rows into the batch."""
        from agents.kv import forward_tokens
        from mappings.cache_io import cache_layers, copy_cache, new_cache, sync_device

        if job.cancel.is_set():
            return self._finish(job, cancelled=True)
        model = self.model.model
        t0 = time.perf_counter()
        try:  # everything up to here is this request's alone: its failure is its own, never the batch's
            cache = copy_cache(job.prefix_cache, model) if job.prefix_cache is not None else new_cache(model)
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
        self._merge(job, cache_layers(cache))

    def _merge(self, job: _Job, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        import torch

        length = job.length
        ones = torch.ones(1, length, dtype=torch.long, device=layers[0][0].device)
        if not self._rows:
            self._keys, self._values = [k for k, _ in layers], [v for _, v in layers]
            self._cache = None
            self._mask = ones
            self._rows = [job]
            return
        assert self._mask is not None
        width = max(self._mask.shape[1], length)
        self._pad_to(width)

        def left(t: torch.Tensor, n: int) -> torch.Tensor:
            if n == 0:
                return t
            return torch.cat([t.new_zeros(*t.shape[:2], n, t.shape[3]), t], dim=2)

        pad = width - length
        self._cache = None
        self._keys = [torch.cat([k, left(nk, pad)], 0) for k, (nk, _) in zip(self._keys, layers, strict=True)]
        self._values = [torch.cat([v, left(nv, pad)], 0) for v, (_, nv) in zip(self._values, layers, strict=True)]
        row_mask = torch.cat([ones.new_zeros(1, pad), ones], 1)
        self._mask = torch.cat([self._mask, row_mask], 0)
        self._rows.append(job)

    def _pad_to(self, width: int) -> None:
        import torch

        assert self._mask is not None
        extra = width - self._mask.shape[1]
        if extra <= 0:
            return
        self._cache = None
        self._keys = [torch.cat([k.new_zeros(*k.shape[:2], extra, k.shape[3]), k], 2) for k in self._keys]
        self._values = [torch.cat([v.new_zeros(*v.shape[:2], extra, v.shape[3]), v], 2) for v in self._values]
        self._mask = torch.cat([self._mask.new_zeros(self._mask.shape[0], extra), self._mask], 1)

    def _step(self) -> None:
        """One forward pass for every row; rows that finish (or were cancelled) leave the batch."""
        import torch

        from mappings.cache_io import cache_layers, forward_with_cache, sync_device

        live = [i for i, job in enumerate(self._rows) if not job.cancel.is_set()]
        if len(live) < len(self._rows):
            for i, job in enumerate(self._rows):
                if i not in live:
                    self._finish(job, cancelled=True)
            self._keep(live)
            if not self._rows:
                return
        assert self._mask is not None
        device = self._mask.device
        tokens = torch.tensor([[job.token] for job in self._rows], dtype=torch.long, device=device)
        positions = torch.tensor([[job.length] for job in self._rows], dtype=torch.long, device=device)
        mask = torch.cat([self._mask, self._mask.new_ones(len(self._rows), 1)], 1)
        if self._cache is None:  # rows changed since the last step: one copy into layers with room
            from orchestra.serve._room import room_cache

            self._cache = room_cache(list(zip(self._keys, self._values, strict=True)))
            self._keys, self._values = [], []  # the copies with room replace them (set again below)
        cache = self._cache
        with self.lock:
            logits, cache, _ = forward_with_cache(self.model.model, tokens, cache, attention_mask=mask,
                                                  position_ids=positions, logits_to_keep=1)
            sync_device(self.model.device)
        self.steps += 1
        self.rows_stepped += len(self._rows)
        layers = cache_layers(cache)
        self._keys, self._values, self._mask = [k for k, _ in layers], [v for _, v in layers], mask
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
        if not rows:
            self._reset()
            return
        assert self._mask is not None
        index = self._mask.new_tensor(rows)
        self._cache = None
        self._keys = [k.index_select(0, index) for k in self._keys]
        self._values = [v.index_select(0, index) for v in self._values]
        self._mask = self._mask.index_select(0, index)
        self._rows = [self._rows[i] for i in rows]
        used = self._mask.any(0).nonzero()
        first = int(used[0]) if used.numel() else 0
        if first:
            self._keys = [k[:, :, first:] for k in self._keys]
            self._values = [v[:, :, first:] for v in self._values]
            self._mask = self._mask[:, first:]

    def _reset(self) -> None:
        self._rows, self._keys, self._values, self._mask, self._cache = [], [], [], None, None
