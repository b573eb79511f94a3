"""The Executor is the whole contract: a subclass implementing only its abstract methods serves every
FamilyCache path through `run`, and `make_executor` builds executors by name from one table."""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import pytest
import torch

from mappings import cache_layers
from mappings.repair import RepairPolicy
from orchestra.errors import ExecutorError, ExecutorUnavailableError, install_command
from orchestra.family.corpus import data_text
from orchestra.familycache import (
    EXECUTORS,
    CachePolicy,
    Executor,
    FamilyCache,
    LocalExecutor,
    UnknownExecutorError,
    make_executor,
)
from orchestra.familycache.gates import GatePolicy
from orchestra.models.registry import ModelRegistry

PERMISSIVE = GatePolicy.model_validate({"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0,
                                                                   "max_excess_kl": 100.0}})


class MinimalExecutor(Executor):
    """Only the abstract methods: models from a registry, ops in the caller's thread, every op recorded."""

    def __init__(self, registry: ModelRegistry) -> None:
        self._models = registry
        self.ops: list[tuple[str, tuple[str, ...]]] = []

    def info(self, member: str) -> Any:
        return self._models.info(member)

    def run(self, members: Sequence[str], op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.ops.append((op.__name__, tuple(members)))
        models = [self._models.load(m) for m in members]
        with ExitStack() as stack:
            for model in sorted({id(m.lock): m for m in models}.values(), key=lambda m: str(m.info.path)):
                stack.enter_context(model.lock)
            return op(*models, *args, **kwargs)

    async def generate(self, member: str, spec: Any, *, prefix_ids: Sequence[int], prefix_cache: Any,
                       upstream: dict[str, Any], on_token: Callable[[Any], Any] | None = None,
                       placement: dict[str, Any] | None = None) -> Any:
        from agents.streaming import run_agent

        model = self._models.load(member)
        return await run_agent(model.model, model.tokenizer, spec, prefix_ids=prefix_ids, prefix_cache=prefix_cache,
                               upstream=upstream, on_token=on_token, lock=model.lock)

    def dtype(self, member: str) -> str:
        return self._models.dtype

    def tokenizer(self, member: str) -> Any:
        return self._models.load(member).tokenizer

    def lock(self, member: str) -> threading.Lock:
        return self._models.load(member).lock

    @property
    def members(self) -> Sequence[str]:
        return list(self._models.aliases)


@pytest.fixture(scope="module")
def registry(fam):
    return ModelRegistry({"base": str(fam.parent), "child": str(fam.child)}, default_device="cpu")


def _ids(registry, text: str) -> list[int]:
    return registry.load("base").tokenizer(text, add_special_tokens=False)["input_ids"]


def _cache(executor, mapstore, **policy) -> FamilyCache:
    return FamilyCache(executor, mapstore, source="base",
                       policy=CachePolicy(gate=PERMISSIVE, min_mapped_tokens=16, repair_costs="compute", **policy))


def _same(a, b) -> bool:
    return all(torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)
               for (k1, v1), (k2, v2) in zip(cache_layers(a), cache_layers(b), strict=True))


# -- a custom executor with only the abstract methods --------------------------------------------------------
def test_custom_executor_serves_exact_prefixes_through_its_run(registry, mapstore):
    executor = MinimalExecutor(registry)
    cache = _cache(executor, mapstore)
    doc = _ids(registry, data_text("gpl-3.txt")[:250])
    with cache.acquire_sync("base", doc) as first:
        assert first.path == "exact" and first.computed_tokens == len(doc)
    with cache.acquire_sync("base", doc[:100]) as prefix:  # a prefix of the entry: truncated, nothing computed
        assert prefix.hit and prefix.computed_tokens == 0 and prefix.tokens == 100
    ran = [name for name, _ in executor.ops]
    assert ran == ["compute_tokens", "truncate"]  # the base class's truncate() went through run()
    with FamilyCache(LocalExecutor(registry), mapstore, source="base").acquire_sync("base", doc[:100]) as local:
        assert _same(prefix.cache, local.cache)


@pytest.mark.parametrize("repair", [None, RepairPolicy(budget=0.3, scattered_share=0.5, probe_tokens=8)],
                         ids=["pure-map", "scattered-repair-reads-the-source"])
def test_custom_executor_maps_across_members_like_the_local_one(registry, mapstore, repair):
    doc = _ids(registry, data_text("gpl-3.txt")[:250])
    question = _ids(registry, " What does the licence allow?")
    leases = []
    executor = MinimalExecutor(registry)
    for ex in (executor, LocalExecutor(registry)):
        cache = _cache(ex, mapstore, repair=repair)
        with cache.acquire_sync("base", doc):
            lease = cache.acquire_sync("child", doc + question)
        leases.append(lease)
        lease.release()
    custom, local = leases
    assert custom.path == local.path == "mapped" and custom.source == "base"
    assert custom.gate_dicts() and [g["passed"] for g in custom.gate_dicts()] == [g["passed"] for g in local.gate_dicts()]
    assert _same(custom.cache, local.cache)
    ran = dict.fromkeys(executor.ops)
    # the mapping, the probe reference and the map all reached the custom executor's run(), holding what they need
    assert ("load_mapping", ("base", "child")) in ran and ("probe_reference", ("base", "child")) in ran
    if repair is None:
        assert ("map_on_target", ("child",)) in ran
    else:
        assert ("map_with_source", ("base", "child")) in ran and custom.repair and custom.repair["tokens"] > 0


def test_default_stream_runs_the_op_in_process_with_a_state_per_member(registry):
    executor = MinimalExecutor(registry)
    assert executor.in_process and executor.kind == "local"
    assert executor.model("base") is registry.load("base")  # through run(): the model it holds

    def count(model, n: int, *, emit, cancel, state) -> str:
        state["calls"] = state.get("calls", 0) + 1
        for i in range(n):
            emit((model.info.alias, i))
        return f"{state['calls']} calls"

    items: list[Any] = []
    assert executor.stream("base", count, 3, on_item=items.append) == "1 calls"
    assert executor.stream("base", count, 1, on_item=items.append) == "2 calls"
    assert executor.stream("child", count, 0, on_item=items.append) == "1 calls"
    assert items == [("base", 0), ("base", 1), ("base", 2), ("base", 0)]


def test_executor_without_a_registry_says_so(registry):
    with pytest.raises(ExecutorError, match="MinimalExecutor was not built over a ModelRegistry"):
        _ = MinimalExecutor(registry).registry


# -- make_executor -------------------------------------------------------------------------------------------
def test_make_executor_builds_local_over_the_registry(registry):
    executor = make_executor("local", registry, max_concurrency_per_device=3)
    assert type(executor) is LocalExecutor and executor.registry is registry
    assert executor.max_concurrency_per_device == 3 and executor.in_process and executor.kind == "local"


def test_make_executor_builds_ray_without_starting_it(registry):
    pytest.importorskip("ray")
    from orchestra.familycache._ray import RayExecutor
    from orchestra.pipelines.spec import ExecutorSpec

    spec = ExecutorSpec(kind="ray", num_cpus=0.5)
    executor = make_executor("ray", registry, spec, members=["base"], name="contract")
    try:
        assert type(executor) is RayExecutor and executor.spec is spec and executor.name == "contract"
        assert executor.kind == "ray" and not executor.in_process and executor.registry is registry
        assert executor.placement() == {}  # nothing started: no Ray, no actors
        with pytest.raises(ExecutorError, match="in its actors"):
            executor.model("base")
    finally:
        executor.close()


def test_make_executor_refuses_an_unknown_kind_listing_the_known_ones(registry):
    with pytest.raises(UnknownExecutorError, match=r"unknown executor kind 'dask'; known kinds: local, ray") as err:
        make_executor("dask", registry)
    assert isinstance(err.value, ExecutorError)


def test_make_executor_says_how_to_install_ray_when_it_cannot_be_imported(registry, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    monkeypatch.delitem(sys.modules, "orchestra.familycache._ray", raising=False)
    hint = r"the ray executor needs Ray \(.*\): " + re.escape(install_command("ray"))
    with pytest.raises(ExecutorUnavailableError, match=hint):
        make_executor("ray", registry)


def test_make_executor_closes_an_executor_that_fails_to_start(registry, monkeypatch):
    closed: list[bool] = []

    class Unplaceable(LocalExecutor):
        def start(self) -> None:
            raise ExecutorUnavailableError("no room on the cluster")

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setitem(EXECUTORS, "unplaceable", Unplaceable)
    assert type(make_executor("unplaceable", registry)) is Unplaceable and not closed  # not started: kept
    with pytest.raises(ExecutorUnavailableError, match="no room"):
        make_executor("unplaceable", registry, start=True)
    assert closed == [True]


def test_make_executor_refuses_a_table_entry_that_is_not_an_executor(registry, monkeypatch):
    monkeypatch.setitem(EXECUTORS, "bogus", "orchestra.familycache._ops:Computed")
    with pytest.raises(ExecutorError, match="not an Executor"):
        make_executor("bogus", registry)
