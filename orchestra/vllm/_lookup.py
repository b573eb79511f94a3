"""The family side of the connector: what the store holds for a prompt, and mapped caches built by FamilyCache.

It runs in vLLM's scheduler process. Finding what the store holds reads file names and headers only, so it
is answered inside the scheduler's step. A mapped cache is built by orchestra's own `FamilyCache` (the same
route, gates, exact sinks, repair and recomputed tail as every other orchestra run) on the family's models,
loaded here with transformers the first time a map is needed, and handed to the worker as a file; the map
itself runs in a background thread while vLLM is told to ask again.
"""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestra.errors import OrchestraError

if TYPE_CHECKING:
    from mappings.types import Tensor
    from orchestra.familycache import FamilyCache, KVStore, LocalExecutor, Namespace, StoredEntry
    from orchestra.familycache.mapping_store import MappingStore
    from orchestra.vllm._settings import ConnectorSettings

__all__ = ["FamilyLookup", "StoredHit", "Mappable", "MappedBuild", "ConnectorSetupError"]


class ConnectorSetupError(OrchestraError):
    """The connector's settings do not fit the engine (another model, an unknown member, no family)."""


@dataclass(frozen=True)
class StoredHit:
    """The member's own exact entry holding the prompt's first `length` tokens."""

    entry: StoredEntry
    length: int


@dataclass(frozen=True)
class Mappable:
    """The longest prefix of a prompt that a mapped build could give a member, and the member it maps from."""

    length: int
    source: str


@dataclass(frozen=True)
class MappedBuild:
    """What FamilyCache made of a prompt's prefix: a cache to load (mapped, or the member's own) or a refusal."""

    length: int
    kind: str
    """``mapped``, or ``refused`` (nothing to load: the engine computes the prefix itself)."""
    handoff: str | None = None
    source: str | None = None
    mapping: str | None = None
    gates: tuple[str, ...] = ()
    reason: str | None = None


class FamilyLookup:
    """The family's store and mappings as one vLLM engine sees them: its member, and the LoRA adapters it serves
    over that member (each a member of its own), for the scheduler side of the connector."""

    def __init__(self, settings: ConnectorSettings, *, dtype: str, model_path: str) -> None:
        from orchestra.family.manifest import load_family
        from orchestra.familycache import KVStore

        self.settings = settings
        try:
            self.family = load_family(settings.home)
        except OrchestraError as exc:
            raise ConnectorSetupError(f"the connector's family home {settings.home!r} holds no family: {exc}") from exc
        self.member = self._member_name(settings.member)
        """The member vLLM's model is (requests without a LoRA)."""
        self._check_model(model_path)
        self.adapters = self._check_adapters(settings.adapters)
        """The engine's LoRA adapters by name (vLLM's ``lora_name``): members of their own over `member`."""
        self.root = next((n for n, r in self.family.members.items() if r.role == "root"), self.member)
        self.dtype = dtype
        self.store: KVStore = KVStore(settings.store_dir, settings.store_mb << 20, min_tokens=settings.min_tokens,
                                      min_new_tokens=settings.min_tokens)
        self._executor: LocalExecutor | None = None
        self._mappings: MappingStore | None = None
        self._caches: dict[str, FamilyCache] = {}
        self._namespaces: dict[str, Namespace] = {}
        self._lock = threading.Lock()
        self._jobs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchestra-vllm-map")
        self.namespace = self.namespace_of(self.member)
        if settings.warm and self._pairs():
            # the models a map needs load now, beside vLLM's start-up, not in the first mapped request
            self._jobs.submit(self._warm)

    # -- set-up -----------------------------------------------------------------------------------------------
    def _member_name(self, key: str) -> str:
        for name, record in self.family.members.items():
            if key in (name, record.role):
                return name
        known = ", ".join(f"{n} ({r.role})" for n, r in self.family.members.items())
        raise ConnectorSetupError(f"the connector's member {key!r} is not in the family at {self.settings.home}: "
                                  f"name one of {known}")

    def _check_model(self, model_path: str) -> None:
        member_path = Path(self.family.member(self.member).path).resolve()
        served = Path(model_path).expanduser()
        if served.exists() and served.resolve() != member_path:
            raise ConnectorSetupError(f"vLLM serves {served} but the connector's member {self.member!r} is "
                                      f"{member_path}: start vLLM on that folder, or name the member it serves")

    def _check_adapters(self, adapters: dict[str, str]) -> dict[str, str]:
        from orchestra.models.modelref import is_adapter_folder

        for name, folder in adapters.items():
            if name in self.family.members:
                raise ConnectorSetupError(f"the connector's adapter {name!r} has the name of a family member: "
                                          f"give the LoRA another name (in --lora-modules and the connector's adapters)")
            if not is_adapter_folder(Path(folder).expanduser()):
                raise ConnectorSetupError(f"the connector's adapter {name!r} is {folder}, which holds no "
                                          f"adapter_config.json: give the folder peft's save_pretrained wrote")
        return {name: str(Path(folder).expanduser().resolve()) for name, folder in adapters.items()}

    @property
    def members(self) -> tuple[str, ...]:
        """What this engine serves: its member, then its adapters."""
        return (self.member, *self.adapters)

    def member_for(self, lora_name: str | None) -> str | None:
        """The member a request runs on (its LoRA's name, or None for the engine's member); None if unknown."""
        if lora_name is None:
            return self.member
        return lora_name if lora_name in self.adapters else None

    @property
    def executor(self) -> LocalExecutor:
        """One executor over the family and the engine's adapters (models load on the first map, not before)."""
        with self._lock:
            if self._executor is None:
                from orchestra.familycache import LocalExecutor
                from orchestra.familycache.mapping_store import MappingStore
                from orchestra.models.modelref import AdapterSpec
                from orchestra.models.registry import ModelRegistry

                aliases: dict[str, str | AdapterSpec] = {n: n for n in self.family.members}
                aliases.update({n: AdapterSpec(adapter=folder, base=self.member) for n, folder in self.adapters.items()})
                registry = ModelRegistry(aliases, family=self.family, default_device="cpu", dtype=self.dtype)
                self._executor = LocalExecutor(registry)
                mapping_dir = Path(self.settings.mapping_dir) if self.settings.mapping_dir else Path(
                    self.family.home) / "mappings"
                self._mappings = MappingStore(mapping_dir, on_missing="calibrate" if self.settings.calibrate else "refuse",
                                              tokens=self.settings.calibrate_tokens)
            return self._executor

    @property
    def mappings(self) -> MappingStore:
        self.executor  # noqa: B018 - builds both
        assert self._mappings is not None
        return self._mappings

    def cache_for(self, source: str) -> FamilyCache:
        """The FamilyCache that maps `source`'s caches (one per source; all share the executor and the store)."""
        executor, mappings = self.executor, self.mappings
        with self._lock:
            if source not in self._caches:
                from orchestra.familycache import CachePolicy, FamilyCache

                gate = {"gate": self.settings.gate} if self.settings.gate is not None else {}
                policy = CachePolicy(tail_tokens=self.settings.tail_tokens,
                                     min_mapped_tokens=self.settings.min_mapped_tokens, **gate)
                self._caches[source] = FamilyCache(executor, mappings, source=source, policy=policy,
                                                   disk=self.store)
            return self._caches[source]

    def namespace_of(self, member: str) -> Namespace:
        """`member`'s exact namespace: where its own caches are stored."""
        with self._lock:
            found = self._namespaces.get(member)
        if found is None:
            found = self.cache_for(self.root).exact_namespace(member)
            with self._lock:
                self._namespaces[member] = found
        return found

    def _sources(self, target: str) -> list[str]:
        """Members whose caches may be mapped into `target`: the family's root and this engine's members."""
        return [m for m in dict.fromkeys((self.root, *self.members)) if m != target]

    def _pairs(self) -> list[tuple[str, str]]:
        """(source, target) for every map into this engine's members that is stored or may be calibrated."""
        pairs = []
        for target in self.members:
            for source in self._sources(target):
                adapter_pair = target in self.adapters and (source == self.member or source in self.adapters)
                if self._has(source, target) or (self.settings.calibrate and adapter_pair and source == self.member):
                    pairs.append((source, target))
        return pairs

    def _has(self, source: str, target: str) -> bool:
        return self.mappings.has(self.executor.info(source), self.executor.info(target))

    def _warm(self) -> None:
        for source, target in self._pairs():
            if not self._has(source, target):  # settings.calibrate: the base's maps into its adapters, now
                self.mappings.get(self.executor.model(source), self.executor.model(target))
            self.executor.model(source)
            self.executor.model(target)

    # -- what the store holds ---------------------------------------------------------------------------------
    def own_entry(self, member: str, ids: tuple[int, ...]) -> StoredHit | None:
        """`member`'s longest stored exact prefix of `ids`."""
        entry, length = self.store.find(self.namespace_of(member), ids)
        return StoredHit(entry, length) if entry is not None else None

    def mappable(self, member: str, ids: tuple[int, ...]) -> Mappable | None:
        """The longest prefix of `ids` another member holds in the store (or a map into `member` does), and whose
        cache it is: what a mapped build would map."""
        from orchestra.familycache._pool import common_prefix

        target = self.namespace_of(member)
        # a source without a map is offered too: its build is refused at once, and the refusal counted
        sources = {self.namespace_of(s).member_fingerprint: s for s in self._sources(member)}
        best: Mappable | None = None
        mappable = {s: self.settings.calibrate or self._has(s, member) for s in sources.values()}
        for entry in self.store.entries():
            ns = entry.namespace
            if ns.dtype != target.dtype:
                continue
            if ns.kind == "mapped":  # a map into this member, built earlier (by any engine)
                source = sources.get(ns.source_fingerprint or "") if ns.member_fingerprint == target.member_fingerprint else None
            else:
                source = sources.get(ns.member_fingerprint)
            if source is None:
                continue
            length = common_prefix(entry.tokens, ids)
            # a source with a map first, then the longest prefix
            if best is None or (mappable[source], length) > (mappable[best.source], best.length):
                best = Mappable(length, source)
        return best

    # -- mapped builds ----------------------------------------------------------------------------------------
    def submit(self, member: str, source: str, ids: tuple[int, ...]) -> Future[MappedBuild]:
        """Build `member`'s cache of `ids` from `source`'s through FamilyCache in the background."""
        return self._jobs.submit(self._build, member, source, ids)

    def _build(self, member: str, source: str, ids: tuple[int, ...]) -> MappedBuild:
        """A mapped cache of `ids`, or a refusal: never a prefill (the engine computes what is not mapped)."""
        cache = self.cache_for(source)
        if not self.settings.calibrate and not self._has(source, member):
            return MappedBuild(0, "refused", reason=f"no mapping {source} -> {member} in {self.mappings.directory}: "
                                                    f"run `orchestra family calibrate`, or set the connector's calibrate")
        try:
            lease = cache.acquire_sync(member, ids)
        except Exception as exc:  # a damaged mapping, a model that will not load: the engine computes
            return MappedBuild(0, "refused", reason=f"{type(exc).__name__}: {exc}")
        with lease:
            gates = tuple(f"{g.gate}={'pass' if g.passed else 'fail'}" for g in lease.gates)
            if lease.path != "mapped":  # a refused gate (FamilyCache re-prefilled), or the member's own entry
                return MappedBuild(0, "refused", gates=gates, reason=lease.fallback_reason or f"path {lease.path}")
            handoff = self._write_handoff(cache.executor.export_cache(member, lease.cache), len(ids))
        return MappedBuild(len(ids), "mapped", handoff, lease.source, lease.mapping, gates)

    def _write_handoff(self, layers: list[tuple[Tensor, Tensor]], length: int) -> str:
        from safetensors.torch import save

        from mappings.atomic import write_atomic

        tensors = {}
        for i, (k, v) in enumerate(layers):
            tensors[f"k.{i}"] = k[..., :length, :].contiguous()
            tensors[f"v.{i}"] = v[..., :length, :].contiguous()
        folder = self.settings.handoff_dir
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{os.getpid()}-{uuid.uuid4().hex}.safetensors"
        write_atomic(path, save(tensors))
        return str(path)

    def close(self) -> None:
        self._jobs.shutdown(wait=True, cancel_futures=True)
        self.store.close()
