"""`await FamilyCache.acquire`: the async bridge over `acquire_sync` (cancel, join, nothing leaked)."""

from __future__ import annotations

import anyio
import pytest

from orchestra.family.corpus import data_text
from orchestra.familycache import CacheLease, FamilyCache
from orchestra.models.registry import ModelRegistry
from tests.orchestra.familycache.test_core import TokenCounter


@pytest.fixture(scope="module")
def registry(fam):
    return ModelRegistry({"base": str(fam.parent), "child": str(fam.child)}, default_device="cpu")


def _ids(registry, text: str) -> list[int]:
    return registry.load("base").tokenizer(text, add_special_tokens=False)["input_ids"]


async def test_acquire_returns_the_lease_of_acquire_sync(registry, mapstore):
    cache = FamilyCache(registry, mapstore, source="base")
    ids = _ids(registry, data_text("gpl-3.txt")[:200])
    lease = await cache.acquire("base", ids)
    assert lease.tokens == len(ids) and lease.path == "exact"
    again = await cache.acquire("base", ids)
    assert again.hit and again.reused_tokens == len(ids)
    lease.release()
    again.release()


async def test_a_cancelled_acquire_waits_for_its_worker_and_releases_the_lease_it_made(registry, mapstore,
                                                                                         monkeypatch):
    cache = FamilyCache(registry, mapstore, source="base")
    ids = _ids(registry, data_text("gpl-3.txt")[:300])
    released: list[int] = []
    real_release = CacheLease.release

    def release(lease: CacheLease) -> None:
        released.append(lease.tokens)
        real_release(lease)

    monkeypatch.setattr(CacheLease, "release", release)
    counter = TokenCounter(registry.load("base").model, delay=0.3)  # a slow forward pass
    try:
        with anyio.move_on_after(0.1) as scope:
            await cache.acquire("base", ids)
        passes_at_exit = len(counter.tokens)
        assert scope.cancelled_caught
        assert counter.active == 0 and passes_at_exit >= 1  # the worker was waited for: no pass still running
        await anyio.sleep(0.4)
        assert len(counter.tokens) == passes_at_exit  # and nothing ran after the caller returned
    finally:
        counter.remove()
    assert released == [len(ids)]  # the lease the worker made meanwhile went back: nobody got it


async def test_errors_of_acquire_sync_surface_unwrapped(registry, mapstore):
    from orchestra.errors import DocumentError

    cache = FamilyCache(registry, mapstore, source="base")
    with pytest.raises(DocumentError, match="no tokens"):
        await cache.acquire("base", [])
