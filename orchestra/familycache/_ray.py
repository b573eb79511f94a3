"""The ray executor: family members as Ray actors, KV caches as ObjectRefs in Ray's object store.

Imported only when a pipeline says ``executor: {kind: ray}`` (``pip install 'orchestra-kv[ray]'``). The
driver keeps everything that decides (the FamilyCache's index, gates and fallback, the DAG, events and
the report); every forward pass runs in an actor, one per (member, replica), placed by one placement
group per pipeline:

- **ops** (the module-level functions of `familycache._ops`) are shipped by reference and run in the
  actor of the member they name, under that model's lock, as `LocalExecutor` runs them; the `Executor`
  methods whose in-process defaults would hold two models at once or copy a cache are overridden here;
- **caches** never come back to the driver: an actor returns each cache it built as a separate
  return value holding its per-layer K/V as numpy arrays, so the driver owns an ObjectRef
  (`RemoteKV`) that FamilyCache entries hold, and another actor on the node reads it zero-copy from
  shared memory. A prefix is a view of the same object (`RemoteKV.view`: no copy, no actor call);
- **maps** run on the target's actor: the mapping is loaded there (`RemoteMapping` is the driver's
  proxy: manifest, path, no tensors) and the source's cache arrives by reference. Ops that need two
  models are split where each model lives: the probe reference (source half, target half) and
  scattered-token repair (the source ranks positions, the target repairs). On-demand calibration
  is refused: it streams both models over the calibration corpus in one process; calibrate offline;
- **generation** runs in the agent's actor; tokens stream back to the driver as they are made
  (a Ray streaming generator) and a cancelled agent stops at its next token. Other streamed work
  (`orchestra serve`'s replies, batched per actor) goes the same way through `stream()`;
- **adapters and quantized views** are members with actors of their own: an actor is given its member's
  registry entry and those of the bases it reads (`_actor_aliases`) and loads its member only, so an
  adapter's actor holds a copy of its base's weights of its own (a local run shares one); at start each
  actor's fingerprint is checked against the driver's;
- **faults**: a dead actor fails the work it was running with `ActorLostError` naming the actor and
  node (a mapped cache then falls back to a re-prefill, an agent fails), Ray restarts it
  (`max_restarts`), and the next call uses the new one; `close()` kills the actors and removes the
  placement group (Ray does the same for a driver that dies).

Bytes of K/V (and hidden states) that one process reads from another's output are counted
(`stats()`): on one node that is a shared-memory read, across nodes a network transfer.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import uuid
import warnings
import weakref
from collections.abc import AsyncIterable, Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    ParamSpec,
    Protocol,
    TypedDict,
    TypeGuard,
    TypeVar,
    cast,
)

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agents.bridge import CancelFlag, in_thread, iterate_sync, start_thread
from orchestra.errors import ActorLostError, ExecutorError, ExecutorUnavailableError, MappingUnavailableError
from orchestra.familycache._executor import Executor
from orchestra.familycache._handles import (
    PackedCache,
    PackedHidden,
    RemoteHidden,
    RemoteKV,
    RemoteMapping,
    WireArray,
)
from orchestra.familycache._ops import Computed, map_on_target, truncate
from orchestra.familycache._requests import (
    ImportanceRequest,
    MappingRequest,
    MappingResult,
    MapRequest,
    MapResult,
    ProbeReferenceRequest,
)

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

    from agents.runner import AgentResult, TokenEvent
    from agents.spec import AgentSpec
    from mappings.store import Mapping as LoadedMapping
    from mappings.types import CacheLike, DeviceLike, KVCache, Tensor, Tokenizer
    from orchestra.familycache._handles import CacheRef, HiddenRef, OnToken
    from orchestra.familycache._settings import ExecutorSpec, MemberResources
    from orchestra.familycache.mapping_store import MappingStoreConfig, ProbeReference, ReferenceWindows
    from orchestra.models.modelref import AdapterSpec, QuantizeSpec
    from orchestra.models.registry import FamilyIndex, LoadedModel, ModelInfo, ModelRegistry

__all__ = ["RayExecutor", "RemoteKV", "RemoteHidden", "RemoteMapping", "NAMESPACE"]

R = TypeVar("R")
T = TypeVar("T")
Item = TypeVar("Item")
_P = ParamSpec("_P")
_T_co = TypeVar("_T_co", covariant=True)

NAMESPACE = "orchestra"
"""Ray namespace of every actor the executor names (``ray.util.list_named_actors`` finds them there)."""


@dataclass
class _Slot:
    kind: str
    index: int
    length: int = 0
    total: int = 0
    position_bytes: int = 0
    nbytes: int = 0
    layers: int = 0


@dataclass
class _SlottedComputed:
    """A ``Computed`` as it travels: its cache and hidden states stand as slots in the op's extra return values."""

    cache: _Slot
    logits: Tensor
    seconds: float
    hidden: _Slot | None = None


# -- packing (in the actor) -----------------------------------------------------------------------------
def _to_numpy(t: Tensor) -> tuple[WireArray, str]:
    import torch

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: carry the bits
        return t.view(torch.int16).numpy(), "bfloat16"
    return t.numpy(), str(t.dtype).removeprefix("torch.")


def _from_numpy(a: WireArray, dtype: str, device: DeviceLike) -> Tensor:
    import torch

    with warnings.catch_warnings():  # the object store's arrays are read-only; ops never write into them
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    if dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    return t.to(device)


def _is_cache(obj: object) -> TypeGuard[KVCache]:
    return not isinstance(obj, (list, tuple, dict)) and hasattr(obj, "layers") and hasattr(obj, "get_seq_length")


def _pack_cache(cache: CacheLike) -> PackedCache:
    from mappings.cache_io import cache_layers

    layers: list[tuple[WireArray, WireArray]] = []
    dtype, length = "float32", 0
    for k, v in cache_layers(cache):
        (kn, dtype), (vn, _) = _to_numpy(k), _to_numpy(v)
        layers.append((kn, vn))
        length = int(k.shape[-2])
    return PackedCache(layers, dtype, length)


def _pack_result(result: object) -> tuple[object, list[PackedCache], list[PackedHidden]]:
    """The op's result with every cache and hidden-state dict replaced by a slot, and those, packed."""
    import torch


    caches: list[PackedCache] = []
    hiddens: list[PackedHidden] = []

    def cache_slot(cache: KVCache) -> _Slot:
        packed = _pack_cache(cache)
        caches.append(packed)
        nbytes = sum(k.nbytes + v.nbytes for k, v in packed.layers)
        return _Slot("kv", len(caches) - 1, packed.length, packed.length, nbytes // max(1, packed.length),
                     nbytes, len(packed.layers))

    def hidden_slot(hidden: dict[int, Tensor]) -> _Slot:
        packed = {i: _to_numpy(h) for i, h in hidden.items()}
        hiddens.append(packed)
        return _Slot("hidden", len(hiddens) - 1, nbytes=sum(a.nbytes for a, _ in packed.values()))

    def walk(obj: object) -> object:
        if isinstance(obj, Computed):
            # built in this process: its cache and hidden states are the tensors themselves, never handles
            assert not isinstance(obj.cache, RemoteKV) and not isinstance(obj.hidden, RemoteHidden)
            return _SlottedComputed(cache=cache_slot(obj.cache), logits=obj.logits.detach().to("cpu"),
                                    seconds=obj.seconds,
                                    hidden=hidden_slot(obj.hidden) if obj.hidden is not None else None)
        if _is_cache(obj):
            return cache_slot(obj)
        if isinstance(obj, torch.Tensor):
            return obj.detach().to("cpu")
        return _through_containers(obj, walk)

    return walk(result), caches, hiddens


def _through_containers(obj: object, walk: Callable[[object], object]) -> object:
    """`walk` applied inside tuples (not named ones), lists and dicts; anything else as it is."""
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(walk(x) for x in obj)
    if isinstance(obj, list):
        return [walk(x) for x in obj]
    if isinstance(obj, dict):
        return {k: walk(v) for k, v in obj.items()}
    return obj


def _unslot(meta: object, kv_ref: ObjectRef[list[PackedCache]], hidden_ref: ObjectRef[list[PackedHidden]],
            producer: str, node: str) -> object:
    """The driver's view of a result: slots become handles on the op's two extra return values."""

    def kv(slot: _Slot) -> RemoteKV:
        return RemoteKV(kv_ref, slot.index, slot.length, slot.total, slot.position_bytes, slot.layers, producer, node)

    def hidden(slot: _Slot) -> RemoteHidden:
        return RemoteHidden(hidden_ref, slot.index, slot.nbytes, producer, node)

    def walk(obj: object) -> object:
        if isinstance(obj, _Slot):
            return kv(obj) if obj.kind == "kv" else hidden(obj)
        if isinstance(obj, _SlottedComputed):
            return Computed(cache=kv(obj.cache), logits=obj.logits, seconds=obj.seconds,
                            hidden=hidden(obj.hidden) if obj.hidden is not None else None)
        return _through_containers(obj, walk)

    return walk(meta)


def _handles(obj: object) -> list[RemoteKV | RemoteHidden]:
    found: list[RemoteKV | RemoteHidden] = []

    def walk(o: object) -> None:
        if isinstance(o, (RemoteKV, RemoteHidden)):
            found.append(o)
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
        elif isinstance(o, dict):
            for x in o.values():
                walk(x)

    walk(obj)
    return found


def _tensor_bytes(obj: object) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return int(obj.numel() * obj.element_size())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x) for x in obj.values())
    if hasattr(obj, "logits") and hasattr(obj, "seconds"):  # Computed
        return _tensor_bytes(obj.logits)
    return 0


# -- the actor ------------------------------------------------------------------------------------------
class _Done(Generic[R]):
    """The last item of a streamed call: the work's result."""

    def __init__(self, result: R) -> None:
        self.result = result


class _WhoAmI(TypedDict):
    actor: str
    node: str
    pid: int
    device: str
    threads: int
    fingerprint: str
    """The fingerprint of the model the actor loaded (the driver checks it against its own resolution)."""


@ray.remote
class MemberActor:
    """One family member's model in its own process; runs ops and agents on it."""

    def __init__(self, name: str, alias: str, aliases: Mapping[str, str | AdapterSpec | QuantizeSpec],
                 family: FamilyIndex | None, device: str, dtype: str, threads: int | None,
                 agents_at_once: int) -> None:
        import torch

        from orchestra.models.registry import ModelRegistry

        torch.set_num_threads(threads or _node_cores())
        self.name, self.alias = name, alias
        # `aliases`: this member's entry and those of the bases it reads (`_actor_aliases`); only it is loaded
        # (an adapter loads its base's weights here first, a view reads its base's files)
        registry = ModelRegistry(aliases, family=family, devices={alias: device}, default_device=device, dtype=dtype)
        self.model = registry.load(alias)
        context = ray.get_runtime_context()
        self.node = f"{ray.util.get_node_ip_address()}/{context.get_node_id()[:8]}"  # type: ignore[no-untyped-call]
        self.mappings: dict[tuple[str, str, str], LoadedMapping] = {}
        self.mapping_lock = threading.Lock()
        self.agents = threading.Semaphore(agents_at_once)
        self.cancels: dict[str, threading.Event] = {}
        self.state: dict[str, object] = {}

    def whoami(self) -> _WhoAmI:
        import torch

        return {"actor": self.name, "node": self.node, "pid": os.getpid(), "device": self.model.device,
                "threads": torch.get_num_threads(), "fingerprint": self.model.info.fingerprint}

    # resolving what the driver sent
    def _cache(self, obj: RemoteKV) -> KVCache:
        from mappings.cache_io import build_cache

        packed = ray.get(obj.ref)[obj.index]
        device, config = self.model.device, self.model.model.config
        layers = [(_from_numpy(k, packed.dtype, device)[..., : obj.length, :],
                   _from_numpy(v, packed.dtype, device)[..., : obj.length, :]) for k, v in packed.layers]
        # this model's layer types for its own caches; another member's (a source to map) as plain layers
        own = len(layers) == getattr(config.get_text_config(), "num_hidden_layers", len(layers))
        return build_cache(layers, config if own else None)

    def _resolve(self, obj: object) -> object:
        """`obj` with every handle in it (inside tuples, lists and dicts) replaced by what it stands for here."""
        if isinstance(obj, RemoteKV):
            return self._cache(obj)
        if isinstance(obj, RemoteHidden):
            packed_h = ray.get(obj.ref)[obj.index]
            return {i: _from_numpy(a, dtype, self.model.device) for i, (a, dtype) in packed_h.items()}
        if isinstance(obj, RemoteMapping):
            return self._mapping(obj.store, obj.source)
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._resolve(x) for x in obj)
        if isinstance(obj, list):
            return [self._resolve(x) for x in obj]
        if isinstance(obj, dict):
            return {k: self._resolve(v) for k, v in obj.items()}
        return obj

    def _resolve_call(self, args: tuple[object, ...],
                      kwargs: dict[str, object]) -> tuple[tuple[object, ...], dict[str, object]]:
        return tuple(self._resolve(x) for x in args), {k: self._resolve(v) for k, v in kwargs.items()}

    def _mapping(self, store: MappingStoreConfig, source: ModelInfo) -> LoadedMapping:
        key = (store.directory, source.fingerprint, self.model.info.fingerprint)
        with self.mapping_lock:
            if key not in self.mappings:
                mapstore = store.build(on_missing="refuse")
                try:
                    # refusing to calibrate, the store reads only the source's info
                    self.mappings[key], _ = mapstore.get(cast("LoadedModel", SimpleNamespace(info=source)), self.model)
                except MappingUnavailableError as exc:
                    if store.on_missing != "calibrate":
                        raise
                    how = ("`orchestra family calibrate` or `orchestra calibrate`"
                           if source.quantized is None and self.model.info.quantized is None else
                           # `orchestra calibrate` loads folders as stored: it would fit the base, not the view
                           "a run of the pipeline on the local executor (mapping.on_missing: calibrate), which "
                           "stores it where this run looks")
                    raise MappingUnavailableError(
                        f"{exc}. The ray executor does not calibrate mappings on demand (calibration runs both "
                        f"models over the calibration corpus in one process): calibrate offline first with "
                        f"{how}") from None
            return self.mappings[key]

    @ray.method(num_returns=3)
    def run(self, op: Callable[..., object], args: tuple[object, ...],
            kwargs: dict[str, object]) -> tuple[object, list[PackedCache], list[PackedHidden]]:
        args, kwargs = self._resolve_call(args, kwargs)
        with self.model.lock:
            result = op(self.model, *args, **kwargs)
        return _pack_result(result)

    def load_mapping(self, store: MappingStoreConfig, source: ModelInfo) -> RemoteMapping:
        mapping = self._mapping(store, source)
        return RemoteMapping((source.fingerprint, self.model.info.fingerprint),
                             str(mapping.path) if getattr(mapping, "path", None) else None, mapping.manifest,
                             True if mapping.residual is not None else None, store, source)

    @ray.method(num_returns="streaming")
    def generate(self, key: str, spec: AgentSpec, prefix_ids: list[int], prefix_cache: CacheRef | None,
                 upstream: dict[str, object]) -> Generator[TokenEvent | _Done[AgentResult], None, None]:
        from agents.runner import generate

        cache = self._cache(prefix_cache) if isinstance(prefix_cache, RemoteKV) else prefix_cache

        def work(emit: Callable[[TokenEvent], None], cancel: threading.Event) -> AgentResult:
            with self.agents:
                return generate(self.model.model, self.model.tokenizer, spec, prefix_ids=prefix_ids,
                                prefix_cache=cache, upstream=upstream, on_token=emit, cancel=cancel,
                                lock=self.model.lock)

        yield from self._streamed(key, work, f"agent-{spec.name}")

    @ray.method(num_returns="streaming")
    def stream(self, key: str, op: Callable[..., object], args: tuple[object, ...],
               kwargs: dict[str, object]) -> Generator[object, None, None]:
        """A streaming op: ``op(model, *args, emit=, cancel=, state=, **kwargs)``; what it emits, then its result.

        The op takes the model's lock itself, per forward pass (so ops and other streams interleave with
        it); `state` is this actor's scratch dict, for what outlives one call (a server's batch decoder).
        """
        args, kwargs = self._resolve_call(args, kwargs)

        def work(emit: Callable[[object], None], cancel: threading.Event) -> object:
            return op(self.model, *args, emit=emit, cancel=cancel, state=self.state, **kwargs)

        yield from self._streamed(key, work, getattr(op, "__name__", "op").strip("_"))

    def _streamed(self, key: str, work: Callable[[Callable[[Item], None], threading.Event], R],
                  name: str) -> Generator[Item | _Done[R], None, None]:
        """Run ``work(emit, cancel)`` in a thread of its own; yield each item it emits as it comes, then `_Done`.

        The one way work streams back to the driver (agents and served replies alike): the driver's
        `cancel(key)`, or the driver dropping the stream, sets `cancel`, which the work checks per token.
        """
        cancel = self.cancels[key] = self.cancels.get(key) or threading.Event()
        try:
            # the work's error is raised here, unwrapped (the driver gets it as the RayTaskError's cause);
            # a stream closed early sets `cancel` and waits for the work to stop
            result = yield from iterate_sync(work, cancel=cancel, thread_name=name)
            yield _Done(result)
        finally:
            cancel.set()
            self.cancels.pop(key, None)

    def cancel(self, key: str) -> None:
        """Stop the agent streaming under `key` at its next token (also when it has not started yet)."""
        self.cancels.setdefault(key, threading.Event()).set()


def _node_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# ops the executor ships that are not FamilyCache's own
def _reference_source_op(model: LoadedModel, corpus: list[tuple[str, str]], tokens: int, window: int,
                         windows: int) -> ReferenceWindows:
    from orchestra.familycache.mapping_store import MappingStore

    return MappingStore(Path("."), corpus=corpus).reference_source(model, tokens, window, windows)


def _reference_target_op(model: LoadedModel, mapping: LoadedMapping, measured: ReferenceWindows,
                         tokens: int) -> ProbeReference:
    from orchestra.familycache.mapping_store import MappingStore

    return MappingStore.reference_target(model, mapping, measured, tokens)


# -- the driver side ------------------------------------------------------------------------------------
class _RemoteMethod(Protocol[_P, _T_co]):
    """An actor method as the driver calls it: ``handle.method.remote(*args)``."""

    def remote(self, *args: _P.args, **kwargs: _P.kwargs) -> _T_co: ...


class _MemberHandle(Protocol):
    """A `MemberActor` as the driver holds it (a Ray ``ActorHandle``): its methods, each called with ``.remote``.

    Ray's own ``ActorHandle`` types every method of the actor as ``Never``; this says what each returns: an
    ObjectRef per return value, or a stream of them (an ``ObjectRefGenerator``) for the streaming ones.
    """

    whoami: _RemoteMethod[[], ObjectRef[_WhoAmI]]
    run: _RemoteMethod[[Callable[..., object], tuple[object, ...], dict[str, object]],
                       tuple[ObjectRef[object], ObjectRef[list[PackedCache]], ObjectRef[list[PackedHidden]]]]
    load_mapping: _RemoteMethod[[MappingStoreConfig, ModelInfo], ObjectRef[RemoteMapping]]
    generate: _RemoteMethod[[str, AgentSpec, list[int], CacheRef | None, dict[str, object]],
                            AsyncIterable[ObjectRef[TokenEvent | _Done[AgentResult]]]]
    stream: _RemoteMethod[[str, Callable[..., object], tuple[object, ...], dict[str, object]],
                          Iterable[ObjectRef[object]]]
    cancel: _RemoteMethod[[str], ObjectRef[None]]


class _InitArgs(TypedDict, total=False):
    """What the executor passes to ``ray.init``."""

    namespace: str
    log_to_driver: bool
    address: str | None
    include_dashboard: bool
    num_cpus: int


@dataclass
class _Actor:
    member: str
    replica: int
    handle: _MemberHandle
    ray_name: str
    node: str = "?"
    busy: int = 0
    suspect: bool = False
    """Its last call failed because it died: wait for Ray to restart it before the next one."""

    @property
    def name(self) -> str:
        return f"{self.member}#{self.replica}"


class RayExecutor(Executor):
    """FamilyCache's model work on Ray actors: one per (member, replica), in one placement group.

    `registry` resolves members on the driver (configs and tokenizers, never weights); `spec` is the
    pipeline's `ExecutorSpec`; `members` the aliases that get actors (default: all of the registry's).
    Ray is started or joined, and the actors made, at the first op.
    """

    def __init__(self, registry: ModelRegistry, spec: ExecutorSpec, *, members: Sequence[str] | None = None,
                 name: str = "pipeline", max_concurrency_per_device: int = 1) -> None:
        self._registry = registry
        self.spec = spec
        self.name = name
        self._members = list(members) if members is not None else list(registry.aliases)
        self.max_concurrency_per_device = max_concurrency_per_device
        self.uid = uuid.uuid4().hex[:8]
        self._actors: dict[str, list[_Actor]] = {}
        self._pg: PlacementGroup | None = None
        self._owns_ray = False
        self._started = False
        self._start_lock = threading.Lock()
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._tokenizers: dict[str, Tokenizer] = {}
        self._stats = {"kv_bytes_moved": 0, "kv_bytes_moved_across_nodes": 0, "result_bytes_to_driver": 0,
                       "remote_calls": 0}
        ref = weakref.ref(self)

        def close_at_exit() -> None:  # a weak reference: the hook must not keep a dropped executor alive
            executor = ref()
            if executor is not None:
                executor.close()

        atexit.register(close_at_exit)

    @classmethod
    def from_spec(cls, registry: ModelRegistry, spec: ExecutorSpec | None = None, *,
                  members: Sequence[str] | None = None, name: str = "pipeline",
                  max_concurrency_per_device: int = 1) -> RayExecutor:
        """Actors for `members` (default: all of the registry's) placed per `spec` (default: Ray's defaults)."""
        from orchestra.familycache._settings import ExecutorSpec

        return cls(registry, spec if spec is not None else ExecutorSpec(kind="ray"), members=members, name=name,
                   max_concurrency_per_device=max_concurrency_per_device)

    # -- Executor: what the driver knows without actors ---------------------------------------------------
    @property
    def kind(self) -> str:
        return "ray"

    @property
    def in_process(self) -> bool:
        """False: the models live in the actors; callers stream work to them."""
        return False

    def parallelism(self, member: str) -> int:
        """The member's replicas: calls go to the least busy actor, so that many run at once."""
        return self.spec.resources(member).replicas

    @property
    def registry(self) -> ModelRegistry:
        """The driver's registry: configs and tokenizers, never weights."""
        return self._registry

    def model(self, member: str) -> LoadedModel:
        """Refused: `member`'s model lives in its actors (stream work to it with `stream`)."""
        raise ExecutorError(f"the ray executor keeps {member}'s model in its actors, not in this process: "
                            f"run work there with stream() or run()")

    @property
    def members(self) -> Sequence[str]:
        return list(self.registry.aliases)

    def info(self, member: str) -> ModelInfo:
        return self.registry.info(member)

    def dtype(self, member: str) -> str:
        return self.registry.dtype_of(member)

    def tokenizer(self, member: str) -> Tokenizer:
        path = str(self.info(member).tokenizer_path)  # an adapter without a tokenizer of its own: its base's
        if path not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[path] = AutoTokenizer.from_pretrained(path)
        return self._tokenizers[path]

    def lock(self, member: str) -> threading.Lock:
        """A driver-side lock per member (forward passes are serialised inside each actor, not by it)."""
        with self._lock:
            return self._locks.setdefault(member, threading.Lock())

    def nbytes(self, cache: CacheRef, *extra: Tensor | HiddenRef | None) -> int:
        from orchestra.familycache._ops import nbytes_of

        total = cache.nbytes if isinstance(cache, RemoteKV) else nbytes_of(cache)
        for item in extra:
            if isinstance(item, RemoteHidden):
                total += item.nbytes
            elif item is not None:
                total += _tensor_bytes(item)
        return total

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def placement(self) -> dict[str, list[dict[str, str]]]:
        """Member -> its actors and their nodes (after the first op)."""
        return {m: [{"actor": a.name, "node": a.node, "ray_name": a.ray_name} for a in actors]
                for m, actors in self._actors.items()}

    # -- starting and stopping ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start or join Ray, reserve the placement group and start every actor (model loads included)."""
        with self._start_lock:
            if self._started:
                return
            self._owns_ray = _connect_ray(self.spec, self._members) or self._owns_ray
            plan = [(member, replica, self.spec.resources(member)) for member in self._members
                    for replica in range(self.spec.resources(member).replicas)]
            pg = _reserve_placement([res for _, _, res in plan], self.spec, f"orchestra-{self.name}-{self.uid}")
            self._pg = pg
            actors: dict[str, list[_Actor]] = {}
            for index, (member, replica, res) in enumerate(plan):
                actors.setdefault(member, []).append(_spawn_actor(self, member, replica, res, pg, index))
            self._actors = actors
            self._started = True
            try:
                every = [a for group in actors.values() for a in group]
                for actor, who in zip(every, ray.get([a.handle.whoami.remote() for a in every]), strict=True):
                    actor.node = who["node"]
                    self._check_fingerprint(actor, who)
            except ray.exceptions.RayActorError as exc:
                self._stop()
                raise ExecutorUnavailableError(f"a member's actor could not start (its model did not load): "
                                               f"{_first_line(exc)}") from exc
            except ExecutorUnavailableError:
                self._stop()
                raise

    def _check_fingerprint(self, actor: _Actor, who: _WhoAmI) -> None:
        """The actor's model is the one the driver resolved: cache keys and mappings are looked up by the
        driver's fingerprint and applied to the actor's model, so they must agree (a node whose files differ,
        or an adapter or view resolved over another base, would map caches with the wrong mapping)."""
        expected = self.info(actor.member).fingerprint
        if who["fingerprint"] != expected:
            raise ExecutorUnavailableError(
                f"actor {actor.name} on node {actor.node} loaded a model whose fingerprint ({who['fingerprint'][:12]}) "
                f"is not the one this process resolved for {actor.member!r} ({expected[:12]}): give every node the "
                f"same files at the same path")

    def close(self) -> None:
        """Kill the actors and remove the placement group (and stop Ray if this executor started it)."""
        with self._start_lock:
            self._stop()

    def _stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if ray.is_initialized():
            for group in self._actors.values():
                for actor in group:
                    try:
                        ray.kill(cast("ActorHandle[MemberActor]", actor.handle), no_restart=True)
                    except Exception:  # already gone
                        pass
            if self._pg is not None:
                try:
                    remove_placement_group(self._pg)
                except Exception:  # already removed
                    pass
            if self._owns_ray:
                ray.shutdown()
                self._owns_ray = False
        self._actors, self._pg = {}, None

    # -- running ops --------------------------------------------------------------------------------------
    def actors(self, member: str) -> list[_Actor]:
        self.start()
        try:
            return self._actors[member]
        except KeyError:
            raise ExecutorError(f"member {member!r} has no actor: the executor runs {', '.join(self._actors)}") from None

    def _pick(self, member: str) -> _Actor:
        """The least busy actor of `member` (blocking: a restarting one is waited for)."""
        group = self.actors(member)
        with self._lock:
            actor = min(group, key=lambda a: (a.suspect, a.busy, a.replica))
            actor.busy += 1
        if actor.suspect:
            try:
                self._revive(actor)
            except BaseException:
                self._done(actor)
                raise
        return actor

    def _revive(self, actor: _Actor) -> None:
        """Wait until Ray has restarted a dead actor (its model reloaded); refresh the node it is on."""
        import time

        deadline = time.monotonic() + self.spec.ready_timeout_s
        while True:
            try:
                who = ray.get(actor.handle.whoami.remote(), timeout=max(1.0, deadline - time.monotonic()))
                actor.node, actor.suspect = who["node"], False
                return
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as exc:
                if time.monotonic() >= deadline:
                    raise self._lost(actor, "restarting", exc) from None
                time.sleep(0.2)
            except ray.exceptions.RayActorError as exc:  # dead for good: restarts exhausted
                raise ActorLostError(
                    f"actor {actor.name} ({actor.ray_name}) is dead and Ray will not restart it again "
                    f"(executor.max_restarts: {self.spec.max_restarts}): {_first_line(exc)}; start the run anew",
                    actor=actor.name, node=actor.node, op="restarting") from None

    def _done(self, actor: _Actor) -> None:
        with self._lock:
            actor.busy -= 1

    def _count_in(self, actor: _Actor, payload: object) -> None:
        with self._lock:
            for handle in _handles(payload):
                size = handle.nbytes
                if handle.producer != actor.name:
                    self._stats["kv_bytes_moved"] += size
                    if handle.node != actor.node:
                        self._stats["kv_bytes_moved_across_nodes"] += size

    def _lost(self, actor: _Actor, what: str, exc: BaseException) -> ActorLostError:
        actor.suspect = True
        return ActorLostError(
            f"actor {actor.name} ({actor.ray_name}) on node {actor.node} died while running {what}: "
            f"{_first_line(exc)}; Ray restarts it (up to {self.spec.max_restarts} times) and the next run uses it",
            actor=actor.name, node=actor.node, op=what)

    def call(self, member: str, op: Callable[..., R], *args: object, actor: _Actor | None = None,
             **kwargs: object) -> R:
        """Run ``op(model, *args, **kwargs)`` in an actor of `member` (the least busy); handles for its caches.

        The result is the op's, except that every cache in it is a `RemoteKV` and every hidden-state dict a
        `RemoteHidden` (what `Executor.run` promises: `CacheRef`, `HiddenRef`).
        """
        return self._call(member, op, args, kwargs, actor)

    def _call(self, member: str, op: Callable[..., R], args: tuple[object, ...], kwargs: dict[str, object],
              actor: _Actor | None = None) -> R:
        actor = actor or self._pick(member)
        try:
            self._count_in(actor, (args, kwargs))
            meta_ref, kv_ref, hidden_ref = actor.handle.run.remote(op, args, kwargs)
            meta = self._get(actor, meta_ref, getattr(op, "__name__", "op").strip("_"))
        finally:
            self._done(actor)
        with self._lock:
            self._stats["remote_calls"] += 1
            self._stats["result_bytes_to_driver"] += _tensor_bytes(meta)
        return cast("R", _unslot(meta, kv_ref, hidden_ref, actor.name, actor.node))

    def _get(self, actor: _Actor, ref: ObjectRef[T], what: str) -> T:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise self._lost(actor, what, exc) from None
        except ray.exceptions.RayTaskError as exc:  # the op raised: the same error as a local run's
            raise _cause(exc) from None

    def run(self, members: Sequence[str], op: Callable[..., R], *args: object, **kwargs: object) -> R:
        if len(members) != 1:
            raise ExecutorError(f"op {getattr(op, '__name__', op)!r} needs {', '.join(members)} in one process, "
                                f"which the ray executor does not do")
        return self._call(members[0], op, args, kwargs)

    # -- the Executor methods done otherwise than in process ------------------------------------------------
    def truncate(self, member: str, cache: CacheRef, length: int) -> CacheRef:
        """A view of the same stored object (no copy, no actor call); a driver-side cache goes to an actor."""
        if isinstance(cache, RemoteKV):
            return cache.view(length)
        return self.call(member, truncate, cache, length)

    def load_mapping(self, req: MappingRequest) -> MappingResult:
        """Loaded in the target's actor (never calibrated: that wants both models in one process); its proxy."""
        actor = self._pick(req.target)
        try:
            ref = actor.handle.load_mapping.remote(req.store.config, self.info(req.source))
            mapping = self._get(actor, ref, f"loading the mapping {req.source} -> {req.target}")
            return MappingResult(mapping, calibrated=False)
        finally:
            self._done(actor)

    def probe_reference(self, req: ProbeReferenceRequest) -> ProbeReference:
        """Read on the driver when stored; else measured in two halves, each in its member's actor."""

        def measure(tokens: int, window: int, windows: int) -> ProbeReference:
            measured = self.call(req.source, _reference_source_op, req.store.corpus, tokens, window, windows)
            return self.call(req.target, _reference_target_op, req.mapping, measured, tokens)

        # with `measure` given, the store reads only the members' infos (the weights stay in the actors)
        s = cast("LoadedModel", SimpleNamespace(info=self.info(req.source)))
        t = cast("LoadedModel", SimpleNamespace(info=self.info(req.target)))
        return req.store.probe_reference(s, t, req.mapping, req.tail, measure=measure)

    def map_cache(self, req: MapRequest) -> MapResult:
        """In the target's actor; a repair that reads the source ranks positions in the source's actor first."""
        importance, seconds = req.importance, None
        if req.source is not None and importance is None and req.repair is not None:
            ranked = self.importance(ImportanceRequest(req.source, req.source_cache, req.ids, req.repair.probe_tokens,
                                                       req.repair.focus_ids))
            importance, seconds = ranked.scores, ranked.seconds
        mapped, summary = self.call(req.target, map_on_target, req.mapping, req.source_cache, list(req.ids), req.tail,
                                    req.repair, req.source_hidden, importance, req.probe, sinks=req.sinks,
                                    costs=req.costs)
        if summary is not None and seconds is not None:
            summary = summary.with_rank_seconds(seconds)
        return MapResult(mapped, summary)

    # -- agents and other streamed work -------------------------------------------------------------------
    async def generate(self, member: str, spec: AgentSpec, *, prefix_ids: Sequence[int],
                       prefix_cache: CacheRef | None, upstream: Mapping[str, object],
                       on_token: OnToken | None = None, placement: dict[str, str] | None = None) -> AgentResult:
        import inspect


        actor = await in_thread(self._pick, member)
        if placement is not None:
            placement.update(actor=actor.name, node=actor.node)
        key = uuid.uuid4().hex
        finished = False
        what = f"agent {spec.name!r}"
        try:
            self._count_in(actor, prefix_cache)
            stream = actor.handle.generate.remote(key, spec, list(prefix_ids), prefix_cache, dict(upstream))
            async for ref in stream:
                try:
                    item = await ref
                except ray.exceptions.RayActorError as exc:
                    raise self._lost(actor, what, exc) from None
                except ray.exceptions.RayTaskError as exc:
                    raise _cause(exc) from None
                if isinstance(item, _Done):
                    finished = True
                    return item.result
                if on_token is not None:
                    maybe = on_token(item)
                    if inspect.isawaitable(maybe):
                        await maybe
            raise ExecutorError(f"{what} on {actor.name}: the stream ended without a result")
        except ray.exceptions.RayActorError as exc:
            raise self._lost(actor, what, exc) from None
        finally:
            self._done(actor)
            if not finished:  # cancelled (timeout, Ctrl-C) or failed: stop decoding at the next token
                self._cancel(actor, key)

    def stream(self, member: str, op: Callable[..., R], *args: object, on_item: Callable[[Any], None],
               cancel: threading.Event | None = None, placement: dict[str, str] | None = None,
               **kwargs: object) -> R:
        """Run a streaming op in an actor of `member` (the least busy); blocking, in the caller's thread.

        ``op(model, *args, emit=, cancel=, state=, **kwargs)`` runs in the actor (a module-level function,
        shipped by reference; handles in `args` arrive as caches) and each item it emits reaches
        `on_item` here as it is made; its return value is returned. Setting `cancel` stops it at its
        next item: at once when it is a `CancelFlag` (a Generation's is), else as the next item arrives here.
        A dead actor fails it with `ActorLostError`.
        """
        actor = self._pick(member)
        if placement is not None:
            placement.update(actor=actor.name, node=actor.node)
        key = uuid.uuid4().hex
        what = getattr(op, "__name__", "op").strip("_")
        unhook: Callable[[], None] | None = None
        check_per_item = cancel is not None and not isinstance(cancel, CancelFlag)
        finished = False
        try:
            self._count_in(actor, (args, kwargs))
            refs = actor.handle.stream.remote(key, op, args, kwargs)
            if isinstance(cancel, CancelFlag):  # the driver's cancel reaches the actor the moment it is set
                unhook = cancel.on_set(partial(self._cancel, actor, key))
            for ref in refs:
                try:
                    item = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise self._lost(actor, what, exc) from None
                except ray.exceptions.RayTaskError as exc:
                    raise _cause(exc) from None
                if isinstance(item, _Done):
                    finished = True
                    return cast("R", item.result)
                on_item(item)
                if check_per_item and cancel is not None and cancel.is_set():  # a plain Event: told once
                    check_per_item = False
                    self._cancel(actor, key)
            raise ExecutorError(f"{what} on {actor.name}: the stream ended without a result")
        except ray.exceptions.RayActorError as exc:
            raise self._lost(actor, what, exc) from None
        finally:
            if unhook is not None:
                unhook()
            self._done(actor)
            with self._lock:
                self._stats["remote_calls"] += 1
            if not finished:
                self._cancel(actor, key)

    @staticmethod
    def _cancel(actor: _Actor, key: str) -> None:
        try:
            actor.handle.cancel.remote(key)
        except Exception:  # the actor is gone
            pass


def _init_from_a_lasting_thread(kwargs: _InitArgs) -> None:
    """`ray.init`, from the main thread or from a daemon thread that lives as long as the process.

    A Ray started here runs its GCS and raylet as children that die with the *thread* that spawned
    them (Linux's parent-death signal follows threads): started from a pool's worker thread (the
    FamilyCache's ops run in anyio's), they would be killed when that idle thread is retired.
    """
    if threading.current_thread() is threading.main_thread():
        ray.init(**kwargs)
        return
    done = threading.Event()
    box: dict[str, BaseException] = {}

    def owner() -> None:
        try:
            ray.init(**kwargs)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        done.set()
        threading.Event().wait()  # never returns: Ray's processes live as long as this process

    start_thread(owner, name="orchestra-ray-owner")
    done.wait()
    if "error" in box:
        raise box["error"]


def _cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:300]
    return type(exc).__name__


def _connect_ray(spec: ExecutorSpec, members: Sequence[str]) -> bool:
    """Start or join Ray as `spec` says, unless this process is connected already; True when it started or
    joined it now (the executor then shuts it down when it closes)."""
    if ray.is_initialized():
        return False
    address = spec.address
    kwargs: _InitArgs = {"namespace": NAMESPACE, "log_to_driver": False}
    if address in (None, "local") and not (address is None and os.environ.get("RAY_ADDRESS")):
        need = sum((spec.resources(m).num_cpus or 1.0) * spec.resources(m).replicas for m in members)
        # logical CPUs: enough for every actor's bundle (each actor still runs torch on the node's cores)
        kwargs.update({"address": "local", "include_dashboard": False, "num_cpus": max(_node_cores(), math.ceil(need))})
    else:
        kwargs["address"] = address
    try:
        _init_from_a_lasting_thread(kwargs)
    except Exception as exc:  # unreachable cluster, bad address
        raise ExecutorUnavailableError(f"cannot start or join Ray at {address or 'local'}: {_first_line(exc)}") from exc
    return True


def _reserve_placement(resources: Sequence[MemberResources], spec: ExecutorSpec, name: str) -> PlacementGroup:
    """A ready placement group of one bundle per actor; ExecutorUnavailableError naming what is missing when the
    cluster cannot place it within the spec's ready timeout."""
    bundles = [{"CPU": float(res.num_cpus or 1.0), **({"GPU": float(res.num_gpus)} if res.num_gpus else {})}
               for res in resources]
    pg: PlacementGroup = placement_group(bundles, strategy=spec.placement, name=name)
    try:
        ray.get(pg.ready(), timeout=spec.ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        need = {k: sum(b.get(k, 0.0) for b in bundles) for k in ("CPU", "GPU")}
        have = ray.cluster_resources()  # type: ignore[no-untyped-call]
        raise ExecutorUnavailableError(
            f"Ray could not place the pipeline's {len(bundles)} actors ({need['CPU']:g} CPU, {need['GPU']:g} GPU, "
            f"strategy {spec.placement}) within {spec.ready_timeout_s:g}s; the cluster has "
            f"{have}: lower executor.num_cpus / members' num_gpus or replicas, or add nodes"
        ) from None
    return pg


def _spawn_actor(ex: RayExecutor, member: str, replica: int, res: MemberResources, pg: PlacementGroup,
                 index: int) -> _Actor:
    """`ex`'s `replica`-th actor of `member`, in bundle `index` of its placement group (its model loads there)."""
    ray_name = f"orchestra.{ex.name}.{ex.uid}.{member}.{replica}"
    device = "cpu" if ex.registry.devices.get(member) == "cpu" else ("auto" if res.num_gpus else "cpu")
    aliases = _actor_aliases(ex.registry, member)
    # ray.remote's stubs type the decorated class as itself, not the ActorClass that has .options
    handle = MemberActor.options(  # type: ignore[attr-defined]
        name=ray_name, namespace=NAMESPACE, num_cpus=res.num_cpus, num_gpus=res.num_gpus or 0,
        max_restarts=ex.spec.max_restarts, max_task_retries=0, max_concurrency=32,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
    ).remote(f"{member}#{replica}", member, aliases, ex.registry.family, device, ex.registry.dtype, res.threads,
             ex.max_concurrency_per_device)
    return _Actor(member, replica, handle, ray_name)


def _actor_aliases(registry: ModelRegistry, member: str) -> dict[str, str | AdapterSpec | QuantizeSpec]:
    """The registry entries `member`'s actor needs: its own, then the chain of bases it reads, as the driver
    resolved them (``{"tuned": AdapterSpec(..., base="root"), "root": "<root's target>"}``); a plain member's
    alone.

    The actor loads `member` only, but an adapter's weights go over its base's (loaded in the actor too: one
    copy of the base per adapter actor, where a local run shares the base member's) and a view quantizes its
    base's weights read from their files; both resolve their base (config, tokenizer, fingerprint) by alias.
    """
    chain: dict[str, str | AdapterSpec | QuantizeSpec] = {}
    alias: str | None = member
    while alias is not None and alias not in chain:
        chain[alias] = registry.aliases[alias]
        info = registry.info(alias)
        lineage = info.adapter or info.quantized
        alias = lineage.base_alias if lineage is not None else None
    return chain
