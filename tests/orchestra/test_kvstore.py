from __future__ import annotations

import pytest
import torch

from orchestra.kvstore import CacheKey, KVStore, cache_nbytes, token_hash


def _cache(n_tokens: int, layers: int = 2):
    return [(torch.zeros(1, 2, n_tokens, 4), torch.zeros(1, 2, n_tokens, 4)) for _ in range(layers)]


def _exact(doc: str = "a") -> CacheKey:
    return CacheKey("exact", model_fingerprint="m1", dtype="float32", rope='{"theta":1e4}', token_hash=token_hash([1, 2, ord(doc)]))


def _mapped(doc: str = "a") -> CacheKey:
    return CacheKey("mapped", model_fingerprint="m1", dtype="float32", rope='{"theta":1e4}',
                    token_hash=token_hash([1, 2, ord(doc)]), source_fingerprint="m0", mapping_id="w1", mapping_version=1)


def test_exact_and_mapped_never_mix():
    store = KVStore()
    mapped = _cache(3)
    store.put(_mapped(), mapped)
    assert store.get(_exact(), namespace="exact") is None  # same model and tokens, but only a mapped cache exists
    assert store.get(_mapped(), namespace="mapped") is mapped
    with pytest.raises(ValueError, match="exact namespace with a mapped key"):
        store.get(_mapped(), namespace="exact")


def test_key_fields_must_match_namespace():
    with pytest.raises(ValueError, match="needs source_fingerprint"):
        CacheKey("mapped", model_fingerprint="m", dtype="float32", rope="", token_hash="t")
    with pytest.raises(ValueError, match="cannot name a mapping"):
        CacheKey("exact", model_fingerprint="m", dtype="float32", rope="", token_hash="t", mapping_id="w")


def test_every_key_field_separates_entries():
    store = KVStore()
    store.put(_exact(), _cache(3))
    base = _exact()
    for change in ({"model_fingerprint": "m2"}, {"dtype": "bfloat16"}, {"rope": '{"theta":5e5}'},
                   {"token_hash": token_hash([9])}, {"variant": "tail=8"}):
        assert store.get(CacheKey(**{**base.__dict__, **change}), namespace="exact") is None
    assert store.get(base, namespace="exact") is not None
    other_mapping = CacheKey(**{**_mapped().__dict__, "mapping_version": 2})
    store.put(_mapped(), _cache(3))
    assert store.get(other_mapping, namespace="mapped") is None


def test_lru_eviction_under_byte_budget_and_hit_rate():
    one = cache_nbytes(_cache(10))
    store = KVStore(budget_bytes=2 * one)
    store.put(_exact("a"), _cache(10))
    store.put(_exact("b"), _cache(10))
    assert store.get(_exact("a"), namespace="exact") is not None  # a is now most recent
    store.put(_exact("c"), _cache(10))
    assert _exact("b") not in store and _exact("a") in store and _exact("c") in store
    assert store.stats.evictions == 1
    assert store.used_bytes <= store.budget_bytes
    assert not store.put(_exact("d"), _cache(100))  # larger than the whole budget
    assert store.stats.rejected == 1
    store.get(_exact("z"), namespace="exact")
    assert store.stats.hits == 1 and store.stats.misses == 1 and store.stats.hit_rate == 0.5


def test_cache_nbytes_reads_dynamic_cache_too():
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(_cache(5)):
        cache.update(k, v, layer)
    assert cache_nbytes(cache) == cache_nbytes(_cache(5)) == 2 * 2 * 2 * 5 * 4 * 4
