"""Where model work runs: the seam between FamilyCache and the machines that hold the models.

FamilyCache never calls a model itself. It hands a module-level function (an *op*, see `_ops.py`)
and its arguments to an `Executor`, which runs it with exclusive use of the named members' models.
The Executor is the whole contract: FamilyCache, the scheduler and the server call only its methods.
The abstract ones are what any executor must do; the rest (computing tokens, truncating a cache,
loading a mapping, the probe reference, mapping a cache, streaming an op, the in-process model) have
defaults here that run the op through `run`, which is exactly what `LocalExecutor` needs. The model work
FamilyCache asks for is typed: one frozen request and result per kind (`_requests.py`), the same for
every executor. A remote executor
(`orchestra.familycache._ray.RayExecutor`: Ray actors, one per member and replica) overrides those it
must do otherwise (two-model work split where each model lives, prefixes as views of a stored handle)
and returns handles (ObjectRefs) instead of caches. `make_executor` (`_factory.py`) builds one by name.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, cast

from orchestra.errors import ExecutorError
from orchestra.familycache._requests import (
    ComputeRequest,
    Importance,
    ImportanceRequest,
    MappingRequest,
    MappingResult,
    MapRequest,
    MapResult,
    PassCostsRequest,
    ProbeReferenceRequest,
    TailLogitsRequest,
)

if TYPE_CHECKING:
    import anyio

    from agents.runner import AgentResult
    from agents.spec import AgentSpec
    from mappings.passcost import PassCosts
    from mappings.types import KVCache, Tensor, Tokenizer
    from orchestra.familycache._handles import CacheRef, HiddenRef, OnToken
    from orchestra.familycache._ops import Computed
    from orchestra.familycache._requests import EngineCache
    from orchestra.familycache._settings import ExecutorSpec
    from orchestra.familycache.gates import GatePolicy
    from orchestra.familycache.mapping_store import ProbeReference
    from orchestra.models.registry import LoadedModel, ModelInfo, ModelRegistry

__all__ = ["Executor", "LocalExecutor"]

R = TypeVar("R")

_STATES_LOCK = threading.Lock()


class Executor(ABC):
    """Runs model work for a FamilyCache; every forward pass on a model goes through here."""

    # -- what every executor must do ------------------------------------------------------------------------
    @abstractmethod
    def info(self, member: str) -> ModelInfo:
        """What is known about `member` without loading weights (fingerprint, RoPE, limits)."""

    @abstractmethod
    def run(self, members: Sequence[str], op: Callable[..., R], *args: object, **kwargs: object) -> R:
        """Run ``op(*models, *args, **kwargs)`` with exclusive use of `members`' models, in order; blocking.

        No other op and no generation runs on any of those models meanwhile. Locks are taken in a
        fixed order, so two ops naming the same members in any order never deadlock. A remote executor
        hands back the op's result with every cache and hidden-state dict in it as a handle
        (`CacheRef`, `HiddenRef`), and takes handles among `args` where the op reads caches.
        """

    @abstractmethod
    async def generate(self, member: str, spec: AgentSpec, *, prefix_ids: Sequence[int],
                       prefix_cache: CacheRef | None, upstream: Mapping[str, object],
                       on_token: OnToken | None = None, placement: dict[str, str] | None = None) -> AgentResult:
        """Run one agent (`agents.AgentSpec`) on `member` over a copy of `prefix_cache`; tokens go to `on_token`.

        Returns the `agents.AgentResult`. Forward passes hold the member's lock per step, so cache work
        and other agents on the member interleave with it. A remote executor fills `placement` (when
        given) with where the agent ran: ``{"actor": ..., "node": ...}``.
        """

    @abstractmethod
    def dtype(self, member: str) -> str:
        """The runtime dtype of `member`'s weights and caches (part of every cache key)."""

    @abstractmethod
    def tokenizer(self, member: str) -> Tokenizer:
        """The member's tokenizer (family members share one; the driver tokenizes documents with it)."""

    @abstractmethod
    def lock(self, member: str) -> threading.Lock:
        """The lock that serialises forward passes on `member` (agents take it per decoding step)."""

    @property
    @abstractmethod
    def members(self) -> Sequence[str]:
        """Every member this executor can run."""

    # -- what callers may ask, with in-process defaults -------------------------------------------------------
    @property
    def kind(self) -> str:
        """What the run report calls this executor (``local``, ``ray``); for reports only, never to branch on."""
        return "local"

    def parallelism(self, member: str) -> int:
        """How many calls on `member` can make progress at once: 1 in process (they take turns on its lock);
        a remote executor with several replicas of the member says how many."""
        return 1

    @property
    def holds_caches(self) -> bool:
        """Whether the document caches are this side's (leases hold them, agents decode over copies of them).

        False for an executor whose engines keep their own caches (vLLM, where the family connector loads a
        document exact or mapped inside the engine): FamilyCache is not asked for them; `engine_cache` warms
        the engine's cache and says which it was."""
        return True

    def engine_cache(self, member: str, ids: Sequence[int], *, mapped: bool = True) -> EngineCache:
        """Have `member`'s engine hold the prefix `ids` (computed, loaded exact, or mapped from another member
        unless `mapped` is False) and say how it got it; only executors whose `holds_caches` is False."""
        raise ExecutorError(f"{type(self).__name__} holds its caches itself: ask the FamilyCache")

    def use_gate(self, gate: GatePolicy) -> None:
        """Take a pipeline's gate policy where this executor's engines gate mapped caches themselves (vLLM's
        connector); FamilyCache gates everything else, so by default there is nothing to do."""
        return None

    @property
    def in_process(self) -> bool:
        """Whether the models live in this process: `model()` works and callers may decode beside a lease.

        False for a remote executor, whose callers stream their work to the models instead (`stream`).
        """
        return True

    @property
    def registry(self) -> ModelRegistry:
        """The ModelRegistry resolving members on this side (configs, tokenizers; weights only in process)."""
        raise ExecutorError(f"{type(self).__name__} was not built over a ModelRegistry")

    def model(self, member: str) -> LoadedModel:
        """`member`'s loaded model in this process (to decode beside its caches); a remote executor refuses.

        Callers take the model's lock per forward pass themselves, as agents do.
        """
        from orchestra.familycache._ops import held_model

        return self.run([member], held_model)

    def start(self) -> None:
        """Acquire now what the first op would (a remote one: its cluster, actors, model loads), so failures
        surface at startup; nothing in process."""
        return None

    def truncate(self, member: str, cache: CacheRef, length: int) -> CacheRef:
        """The first `length` positions of `member`'s `cache` as a new cache; the given one is never modified."""
        from orchestra.familycache._ops import truncate

        return self.run([member], truncate, cache, length)

    def compute(self, req: ComputeRequest) -> Computed:
        """``req.ids[req.start:]`` computed exactly on the member over `req.base` (a prefill when start is 0)."""
        from orchestra.familycache._ops import compute_tokens

        return self.run([req.member], compute_tokens, list(req.ids), req.base, req.start, req.keep_logits,
                        base_hidden=req.base_hidden, want_hidden=req.want_hidden)

    def tail_logits(self, req: TailLogitsRequest) -> Computed:
        """The logits of the request's trailing positions, recomputed over its cache's prefix."""
        from orchestra.familycache._ops import tail_logits

        return self.run([req.member], tail_logits, req.cache, list(req.ids), req.end, req.tail)

    def load_mapping(self, req: MappingRequest) -> MappingResult:
        """The mapping from `req.store`, and whether it was calibrated just now.

        Holds both models (an on-demand calibration runs both); setting `req.cancel` stops a calibration.
        """
        from orchestra.familycache._ops import load_mapping

        mapping, calibrated = self.run([req.source, req.target], load_mapping, req.store, req.cancel)
        return MappingResult(mapping, calibrated)

    def probe_reference(self, req: ProbeReferenceRequest) -> ProbeReference:
        """The pair's probe reference for `req.tail` trailing tokens (stored beside the mapping, else measured)."""
        from orchestra.familycache._ops import probe_reference

        return self.run([req.source, req.target], probe_reference, req.store, req.mapping, req.tail)

    def map_cache(self, req: MapRequest) -> MapResult:
        """The request's source cache mapped onto its target, repaired, its tail recomputed (`MapRequest`).

        Holds the target alone unless the repair reads `req.source`'s model, then both.
        """
        from orchestra.familycache._ops import map_on_target, map_with_source

        if req.source is None:
            computed, summary = self.run([req.target], map_on_target, req.mapping, req.source_cache, list(req.ids),
                                         req.tail, req.repair, req.source_hidden, importance=req.importance,
                                         probe=req.probe, sinks=req.sinks, costs=req.costs)
        else:
            computed, summary = self.run([req.source, req.target], map_with_source, req.mapping, req.source_cache,
                                         list(req.ids), req.tail, req.repair, req.source_hidden, sinks=req.sinks,
                                         costs=req.costs)
        return MapResult(computed, summary)

    def importance(self, req: ImportanceRequest) -> Importance:
        """Per-position attention of the source's last tokens (a scattered-token repair ranks by it)."""
        from orchestra.familycache._ops import source_importance

        scores, seconds = self.run([req.source], source_importance, req.cache, list(req.ids), req.probe_tokens,
                                   req.focus)
        return Importance(scores, seconds)

    def pass_costs(self, req: PassCostsRequest) -> PassCosts:
        """The member's measured pass costs (measured once on this machine, kept in `req.directory`)."""
        from orchestra.familycache._ops import pass_costs

        return self.run([req.member], pass_costs, req.directory)

    def export_cache(self, member: str, cache: CacheRef) -> list[tuple[Tensor, Tensor]]:
        """`member`'s cache as per-layer (K, V) tensors this process can write (the disk tier saves them).

        In process they are the cache's own tensors (no copy; caches are never modified in place); a remote
        executor that cannot hand its caches out raises ExecutorError, and the FamilyCache keeps them in memory.
        """
        if not self.in_process:
            raise ExecutorError(f"{type(self).__name__} keeps its caches in other processes: no disk tier")
        from mappings.cache_io import cache_layers

        return cache_layers(cast("KVCache", cache))

    def import_cache(self, member: str, layers: list[tuple[Tensor, Tensor]]) -> CacheRef:
        """Per-layer (K, V) tensors (read from the disk tier) as a cache of `member`, on its device and dtype."""
        if not self.in_process:
            raise ExecutorError(f"{type(self).__name__} keeps its caches in other processes: no disk tier")
        from orchestra.familycache._ops import import_layers

        return self.run([member], import_layers, layers)

    def stream(self, member: str, op: Callable[..., R], *args: object, on_item: Callable[[Any], None],
               cancel: threading.Event | None = None, placement: dict[str, str] | None = None,
               **kwargs: object) -> R:
        """Run a streaming op on `member`; each item it emits reaches `on_item` as it is made; blocking, its result.

        ``op(model, *args, emit=, cancel=, state=, **kwargs)`` takes the model's lock itself per forward
        pass (so ops and other streams interleave with it); setting `cancel` stops it at its next item;
        `state` is a scratch dict per member that outlives one call (a server's batch decoder). In process
        (this default) it runs in the caller's thread and leaves `placement` alone; a remote executor runs
        it where the model lives and fills `placement` with ``{"actor": ..., "node": ...}``.
        """
        return op(self.model(member), *args, emit=on_item, cancel=cancel or threading.Event(),
                  state=self._stream_state(member), **kwargs)

    def _stream_state(self, member: str) -> dict[str, object]:
        """`member`'s scratch dict for streamed ops (made on first use: subclasses need not call our __init__)."""
        with _STATES_LOCK:
            states: dict[str, dict[str, object]] = self.__dict__.setdefault("_stream_states", {})
            return states.setdefault(member, {})

    def nbytes(self, cache: CacheRef, *extra: Tensor | HiddenRef | None) -> int:
        """Bytes a cache an op returned holds, plus tensors kept beside it (the FamilyCache's byte budget)."""
        from orchestra.familycache._ops import nbytes_of

        # in process the handles are the cache and tensors themselves (a remote executor measures its own)
        return nbytes_of(cast("KVCache", cache), *cast("tuple[Tensor | dict[int, Tensor] | None, ...]", extra))

    def stats(self) -> dict[str, int]:
        """Counters since the executor started (a remote one: bytes moved between processes); empty here."""
        return {}

    def close(self) -> None:
        """Release what the executor holds (remote actors, placement groups); idempotent. Nothing, locally."""
        return None

    # -- how make_executor builds one -------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, registry: ModelRegistry, spec: ExecutorSpec | None = None, *,
                  members: Sequence[str] | None = None, name: str = "pipeline",
                  max_concurrency_per_device: int = 1) -> Executor:
        """One built from a pipeline's or server's settings (`make_executor` calls it); each executor says how."""
        raise ExecutorError(f"{cls.__name__} cannot be built from an executor spec: construct it directly")


class LocalExecutor(Executor):
    """Models in this process (loaded on first use by a ModelRegistry), ops in the caller's thread."""

    def __init__(self, registry: ModelRegistry, *, max_concurrency_per_device: int = 1) -> None:
        self._registry = registry
        self.max_concurrency_per_device = max_concurrency_per_device
        self._limiters: dict[str, anyio.CapacityLimiter] = {}

    @classmethod
    def from_spec(cls, registry: ModelRegistry, spec: ExecutorSpec | None = None, *,
                  members: Sequence[str] | None = None, name: str = "pipeline",
                  max_concurrency_per_device: int = 1) -> LocalExecutor:
        """Every member of `registry`, in process (the spec's placement settings and `name` are Ray's)."""
        return cls(registry, max_concurrency_per_device=max_concurrency_per_device)

    @property
    def registry(self) -> ModelRegistry:
        return self._registry

    @property
    def members(self) -> Sequence[str]:
        return list(self._registry.aliases)

    def info(self, member: str) -> ModelInfo:
        return self._registry.info(member)

    def model(self, member: str) -> LoadedModel:
        return self._registry.load(member)

    def tokenizer(self, member: str) -> Tokenizer:
        return self._registry.load(member).tokenizer

    def dtype(self, member: str) -> str:
        return self._registry.dtype_of(member)

    async def generate(self, member: str, spec: AgentSpec, *, prefix_ids: Sequence[int],
                       prefix_cache: CacheRef | None, upstream: Mapping[str, object],
                       on_token: OnToken | None = None, placement: dict[str, str] | None = None) -> AgentResult:
        import anyio

        from agents.bridge import in_thread
        from agents.streaming import run_agent

        model = await in_thread(self._registry.load, member)
        limiter = self._limiters.get(model.device)
        if limiter is None:  # agents running at once per device (their steps still take the model lock)
            limiter = self._limiters[model.device] = anyio.CapacityLimiter(self.max_concurrency_per_device)
        # in process a cache handle is the cache itself
        cache = cast("KVCache | None", prefix_cache)
        return await run_agent(model.model, model.tokenizer, spec, prefix_ids=prefix_ids, prefix_cache=cache,
                               upstream=upstream, on_token=on_token, limiter=limiter, lock=model.lock)

    def lock(self, member: str) -> threading.Lock:
        return self._registry.load(member).lock

    @contextmanager
    def exclusive(self, members: Sequence[str]) -> Iterator[list[LoadedModel]]:
        """Hold the locks of `members` (each once, sorted by the lock's model path), yielding their models."""
        models = [self._registry.load(m) for m in members]
        distinct = {id(m.lock): m for m in models}
        with ExitStack() as stack:
            for model in sorted(distinct.values(), key=lambda m: (str(m.info.path), m.info.alias)):
                stack.enter_context(model.lock)
            yield models

    def run(self, members: Sequence[str], op: Callable[..., R], *args: object, **kwargs: object) -> R:
        with self.exclusive(members) as models:
            return op(*models, *args, **kwargs)
