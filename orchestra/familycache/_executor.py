"""Where model work runs: the seam between FamilyCache and the machines that hold the models.

FamilyCache never calls a model itself. It hands a module-level function (an *op*, see `_ops.py`)
and its arguments to an `Executor`, which runs it with exclusive use of the named members' models.
`LocalExecutor` runs ops in the calling thread under each model's lock; a remote executor
(`orchestra.familycache._ray.RayExecutor`: Ray actors, one per member and replica) runs the same
picklable ops where the weights live and returns handles (ObjectRefs) instead of caches.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from orchestra.registry import LoadedModel, ModelInfo, ModelRegistry

__all__ = ["Executor", "LocalExecutor"]

R = TypeVar("R")


class Executor(ABC):
    """Runs model work for a FamilyCache; every forward pass on a model goes through here."""

    @abstractmethod
    def info(self, member: str) -> ModelInfo:
        """What is known about `member` without loading weights (fingerprint, RoPE, limits)."""

    @abstractmethod
    def run(self, members: Sequence[str], op: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run ``op(*models, *args, **kwargs)`` with exclusive use of `members`' models, in order; blocking.

        No other op and no generation runs on any of those models meanwhile. Locks are taken in a
        fixed order, so two ops naming the same members in any order never deadlock.
        """

    @abstractmethod
    async def generate(self, member: str, spec: Any, *, prefix_ids: Sequence[int], prefix_cache: Any,
                       upstream: dict[str, Any], on_token: Callable[[Any], Any] | None = None,
                       placement: dict[str, Any] | None = None) -> Any:
        """Run one agent (`agents.AgentSpec`) on `member` over a copy of `prefix_cache`; tokens go to `on_token`.

        Returns the `agents.AgentResult`. Forward passes hold the member's lock per step, so cache work
        and other agents on the member interleave with it. A remote executor fills `placement` (when
        given) with where the agent ran: ``{"actor": ..., "node": ...}``.
        """

    @abstractmethod
    def dtype(self, member: str) -> str:
        """The runtime dtype of `member`'s weights and caches (part of every cache key)."""

    @abstractmethod
    def tokenizer(self, member: str) -> Any:
        """The member's tokenizer (family members share one; the driver tokenizes documents with it)."""

    @abstractmethod
    def lock(self, member: str) -> threading.Lock:
        """The lock that serialises forward passes on `member` (agents take it per decoding step)."""

    @property
    @abstractmethod
    def members(self) -> Sequence[str]:
        """Every member this executor can run."""

    @property
    def kind(self) -> str:
        """What the run report calls this executor (``local``, ``ray``)."""
        return "local"

    def nbytes(self, cache: Any, *extra: Any) -> int:
        """Bytes a cache an op returned holds, plus tensors kept beside it (the FamilyCache's byte budget)."""
        from orchestra.familycache._ops import nbytes_of

        return nbytes_of(cache, *extra)

    def stats(self) -> dict[str, int]:
        """Counters since the executor started (a remote one: bytes moved between processes); empty here."""
        return {}

    def close(self) -> None:
        """Release what the executor holds (remote actors, placement groups); idempotent. Nothing, locally."""
        return None


class LocalExecutor(Executor):
    """Models in this process (loaded on first use by a ModelRegistry), ops in the caller's thread."""

    def __init__(self, registry: ModelRegistry, *, max_concurrency_per_device: int = 1) -> None:
        self.registry = registry
        self.max_concurrency_per_device = max_concurrency_per_device
        self._limiters: dict[str, Any] = {}

    @property
    def members(self) -> Sequence[str]:
        return list(self.registry.aliases)

    def info(self, member: str) -> ModelInfo:
        return self.registry.info(member)

    def load(self, member: str) -> LoadedModel:
        return self.registry.load(member)

    def tokenizer(self, member: str) -> Any:
        return self.registry.load(member).tokenizer

    def dtype(self, member: str) -> str:
        return self.registry.dtype

    async def generate(self, member: str, spec: Any, *, prefix_ids: Sequence[int], prefix_cache: Any,
                       upstream: dict[str, Any], on_token: Callable[[Any], Any] | None = None,
                       placement: dict[str, Any] | None = None) -> Any:
        import anyio
        import anyio.to_thread

        from agents.streaming import run_agent

        model = await anyio.to_thread.run_sync(self.registry.load, member)
        limiter = self._limiters.get(model.device)
        if limiter is None:  # agents running at once per device (their steps still take the model lock)
            limiter = self._limiters[model.device] = anyio.CapacityLimiter(self.max_concurrency_per_device)
        return await run_agent(model.model, model.tokenizer, spec, prefix_ids=prefix_ids, prefix_cache=prefix_cache,
                               upstream=upstream, on_token=on_token, limiter=limiter, lock=model.lock)

    def lock(self, member: str) -> threading.Lock:
        return self.registry.load(member).lock

    @contextmanager
    def exclusive(self, members: Sequence[str]) -> Iterator[list[LoadedModel]]:
        """Hold the locks of `members` (each once, sorted by the lock's model path), yielding their models."""
        models = [self.registry.load(m) for m in members]
        distinct = {id(m.lock): m for m in models}
        with ExitStack() as stack:
            for model in sorted(distinct.values(), key=lambda m: (str(m.info.path), m.info.alias)):
                stack.enter_context(model.lock)
            yield models

    def run(self, members: Sequence[str], op: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        with self.exclusive(members) as models:
            return op(*models, *args, **kwargs)
