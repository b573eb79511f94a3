from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from mappings.cache_io import (
    build_cache,
    cache_kwarg,
    cache_layers,
    cache_length,
    forward_with_cache,
    prefill,
    slice_layers,
)
from mappings.errors import ShapeMismatchError, UnsupportedModelError
from tests.mappings.conftest import load


def _layers(n=3, b=2, h=2, t=5, d=4):
    return [(torch.randn(b, h, t, d), torch.randn(b, h, t, d)) for _ in range(n)]


def test_reads_every_cache_form():
    layers = _layers()
    dynamic = build_cache(layers)
    legacy = tuple((k, v) for k, v in layers)
    old_style = SimpleNamespace(key_cache=[k for k, _ in layers], value_cache=[v for _, v in layers])
    for cache in (dynamic, legacy, old_style):
        got = cache_layers(cache)
        assert len(got) == 3
        for (k, v), (k2, v2) in zip(got, layers, strict=True):
            torch.testing.assert_close(k, k2)
            torch.testing.assert_close(v, v2)
    assert cache_length(dynamic) == cache_length(legacy) == 5


def test_bad_caches_raise_typed_errors():
    with pytest.raises(ShapeMismatchError):
        cache_layers(None)
    with pytest.raises(ShapeMismatchError, match="holds no keys"):
        cache_layers(_empty_dynamic())
    with pytest.raises(ShapeMismatchError, match="not a \\(key, value\\) pair"):
        cache_layers((torch.zeros(1),))
    with pytest.raises(UnsupportedModelError):
        cache_layers(object())


def _empty_dynamic():
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    cache.layers = [DynamicLayer()]
    return cache


def test_build_cache_moves_dtype():
    cache = build_cache(_layers(), dtype=torch.bfloat16)
    assert all(k.dtype == torch.bfloat16 for k, _ in cache_layers(cache))
    sliced = slice_layers(_layers(t=7), 2, 5)
    assert sliced[0][0].shape[2] == 3


def test_cache_kwarg_detection():
    class New:
        def forward(self, input_ids, cache=None): ...

    class Old:
        def forward(self, input_ids, past_key_values=None): ...

    assert cache_kwarg(New()) == "cache"
    assert cache_kwarg(Old()) == "past_key_values"


def test_continuing_after_a_rebuilt_cache_equals_full_forward(tiny_family):
    model = load(tiny_family.parent)
    ids = torch.randint(3, 300, (2, 24))
    full, _ = prefill(model, ids)
    _, cache = prefill(model, ids[:, :16])
    rebuilt = build_cache(cache_layers(cache), model.config)
    logits, after, _ = forward_with_cache(model, ids[:, 16:], rebuilt)
    torch.testing.assert_close(logits, full[:, 16:], atol=1e-5, rtol=1e-4)
    assert cache_length(after) == 24
    # legacy tuples are accepted as input too
    legacy = tuple(cache_layers(cache))
    logits2, _, _ = forward_with_cache(model, ids[:, 16:], legacy)
    torch.testing.assert_close(logits2, full[:, 16:], atol=1e-5, rtol=1e-4)
