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
    copy_cache,
    forward_with_cache,
    model_device,
    model_dtype,
    new_cache,
    prefill,
    slice_layers,
    sync_device,
    truncate_cache,
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


def test_truncate_cache_keeps_a_prefix_as_views_and_leaves_the_input_alone(tiny_family):
    model = load(tiny_family.parent)
    ids = torch.randint(3, 300, (1, 20))
    full, cache = prefill(model, ids)
    before = [(k.clone(), v.clone()) for k, v in cache_layers(cache)]
    short = truncate_cache(cache, 12, model.config)
    assert cache_length(short) == 12 and cache_length(cache) == 20
    k_short, k_full = cache_layers(short)[0][0], cache_layers(cache)[0][0]
    assert k_short.data_ptr() == k_full.data_ptr()  # a view of the input, not a copy
    logits, _, _ = forward_with_cache(model, ids[:, 12:], short)
    torch.testing.assert_close(logits, full[:, 12:], atol=1e-5, rtol=1e-4)
    for (k, v), (k0, v0) in zip(cache_layers(cache), before, strict=True):  # continuing never wrote into it
        assert k.shape[-2] == 20 and torch.equal(k, k0) and torch.equal(v, v0)
    assert cache_length(truncate_cache(tuple(before), 5)) == 5  # legacy tuples too
    with pytest.raises(ShapeMismatchError, match="cannot keep 21 positions"):
        truncate_cache(cache, 21)


def test_copy_cache_is_private_and_follows_the_model(tiny_family):
    model = load(tiny_family.parent)
    _, cache = prefill(model, torch.randint(3, 300, (1, 9)))
    twin = copy_cache(cache, model)
    assert type(twin) is type(cache) and cache_length(twin) == 9
    cache_layers(twin)[0][0].add_(1)
    assert not torch.equal(cache_layers(twin)[0][0], cache_layers(cache)[0][0])
    as_f64 = copy_cache(cache, torch.nn.Linear(2, 2).double())
    assert all(k.dtype == v.dtype == torch.float64 for k, v in cache_layers(as_f64))
    assert all(k.dtype == torch.float32 for k, _ in cache_layers(cache))
    legacy = copy_cache(tuple(cache_layers(cache)), model)  # legacy tuples come back as a cache object
    assert isinstance(legacy, DynamicCache) and cache_length(legacy) == 9


def test_new_cache_device_dtype_and_sync(tiny_family):
    model = load(tiny_family.parent)
    empty = new_cache(model)
    assert isinstance(empty, DynamicCache) and cache_length(empty) == 0
    assert model_device(model) == torch.device("cpu") and model_dtype(model) == torch.float32

    class Mixed(torch.nn.Module):  # an integer parameter first: the dtype is the first floating one
        def __init__(self):
            super().__init__()
            self.codes = torch.nn.Parameter(torch.zeros(2, dtype=torch.int8), requires_grad=False)
            self.scale = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))

    assert model_dtype(Mixed()) == torch.bfloat16
    for device in ("cpu", torch.device("cpu"), "meta"):
        sync_device(device)  # no-op off CUDA, str or torch.device
    if torch.cuda.is_available():
        sync_device("cuda:0")
        sync_device(torch.device("cuda", 0))
