from __future__ import annotations

import pytest
import torch

from mappings.apply import LayerMap, LinearKVMap, exact_prefix, identity_map, map_cache, tail_recompute
from mappings.cache_io import build_cache, cache_layers, cache_length, forward_with_cache, prefill
from mappings.capture import kv_shape
from mappings.errors import DocumentTooLongError, NonFiniteKVError, ShapeMismatchError
from mappings.rope import RopeSpec
from tests.mappings.conftest import load


def _doc_ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def test_identity_map_returns_the_source_cache(llama_family):
    model = load(llama_family.parent)
    _, cache = prefill(model, _doc_ids(20))
    mapped = map_cache(identity_map(model.config, model.config), cache, model)
    for (k, v), (k2, v2) in zip(cache_layers(mapped), cache_layers(cache), strict=True):
        torch.testing.assert_close(k, k2)
        torch.testing.assert_close(v, v2)


def test_mapped_cache_is_accepted_and_generation_runs(tiny_mapping):
    fam = tiny_mapping.family
    source, target = load(fam.parent), load(fam.child)
    ids = _doc_ids(40)
    _, src_cache = prefill(source, ids[:, :32])
    mapped = map_cache(tiny_mapping.mapping.kv_map, src_cache, target)
    assert cache_length(mapped) == 32
    shape = kv_shape(target.config)
    for k, v in cache_layers(mapped):
        assert k.shape == v.shape == (1, shape.kv_heads, 32, shape.head_dim)
        assert k.dtype == target.dtype
    out = target.generate(ids, cache=mapped, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 45)
    logits, _, _ = forward_with_cache(target, ids[:, 32:], map_cache(tiny_mapping.mapping.kv_map, src_cache, target))
    assert torch.isfinite(logits).all()


def test_batched_mapping_equals_per_row(tiny_mapping):
    fam = tiny_mapping.family
    source = load(fam.parent)
    ids = torch.cat([_doc_ids(24, 1), _doc_ids(24, 2)])
    _, cache = prefill(source, ids)
    kv_map = tiny_mapping.mapping.kv_map
    both = kv_map.apply(cache_layers(cache))
    _, single = prefill(source, ids[1:])
    one = kv_map.apply(cache_layers(single))
    for (k, v), (k1, v1) in zip(both, one, strict=True):
        torch.testing.assert_close(k[1:], k1, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v[1:], v1, atol=1e-5, rtol=1e-4)


def test_tail_recompute_is_exact_over_an_exact_prefix(llama_family):
    model = load(llama_family.parent)
    ids = _doc_ids(30)
    full, _ = prefill(model, ids)
    _, cache = prefill(model, ids[:, :30])
    mapped = map_cache(identity_map(model.config, model.config), cache, model)
    logits, after = tail_recompute(model, mapped, ids, 8)  # cache cut back to 22, last 8 recomputed
    assert cache_length(after) == 30
    torch.testing.assert_close(logits, full[:, 22:], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError):
        tail_recompute(model, mapped, ids, 31)


def test_tail_recompute_makes_the_tail_kv_the_targets_own(tiny_mapping):
    fam = tiny_mapping.family
    source, target = load(fam.parent), load(fam.child)
    ids = _doc_ids(32)
    _, src_cache = prefill(source, ids[:, :24])
    mapped = map_cache(tiny_mapping.mapping.kv_map, src_cache, target)
    _, after = tail_recompute(target, mapped, ids[:, :32], 8)
    # the recomputed positions are exactly what the target computes over the mapped prefix
    _, manual, _ = forward_with_cache(target, ids[:, 24:32], map_cache(tiny_mapping.mapping.kv_map, src_cache, target))
    for (k, _), (k2, _) in zip(cache_layers(after), cache_layers(manual), strict=True):
        torch.testing.assert_close(k[:, :, 24:], k2[:, :, 24:])


def test_exact_prefix_makes_the_first_positions_the_targets_own(tiny_mapping):
    fam = tiny_mapping.family
    source, target = load(fam.parent), load(fam.child)
    ids = _doc_ids(24)
    _, src_cache = prefill(source, ids)
    _, own = prefill(target, ids)
    mapped = map_cache(tiny_mapping.mapping.kv_map, src_cache, target)
    before = [(k.clone(), v.clone()) for k, v in cache_layers(mapped)]
    assert exact_prefix(target, mapped, ids, 4) == 4
    for (k, v), (ok, ov), (bk, bv) in zip(cache_layers(mapped), cache_layers(own), before, strict=True):
        torch.testing.assert_close(k[:, :, :4], ok[:, :, :4], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v[:, :, :4], ov[:, :, :4], atol=1e-5, rtol=1e-4)
        assert torch.equal(k[:, :, 4:], bk[:, :, 4:]) and torch.equal(v[:, :, 4:], bv[:, :, 4:])
    # the map was not exact there: the call changed something
    assert any(not torch.allclose(bk[:, :, :4], ok[:, :, :4], atol=1e-4) for (bk, _), (ok, _) in
               zip(before, cache_layers(own), strict=True))
    assert exact_prefix(target, mapped, ids, 0) == 0
    assert exact_prefix(target, mapped, ids, 100) == 24  # never past the cache


def test_wrong_source_cache_is_refused(tiny_mapping):
    kv_map = tiny_mapping.mapping.kv_map
    s = kv_map.source_shape
    wrong_heads = [(torch.zeros(1, s.kv_heads + 1, 4, s.head_dim),) * 2] * s.num_layers
    with pytest.raises(ShapeMismatchError, match="another source model"):
        kv_map.apply(wrong_heads)
    with pytest.raises(ShapeMismatchError, match="layers"):
        kv_map.apply([(torch.zeros(1, s.kv_heads, 4, s.head_dim),) * 2] * (s.num_layers + 1))


def test_cache_longer_than_target_positions_is_refused(llama_family):
    model = load(llama_family.parent)
    shape = kv_shape(model.config)
    too_long = build_cache([(torch.zeros(1, shape.kv_heads, 600, shape.head_dim),) * 2] * shape.num_layers)
    with pytest.raises(DocumentTooLongError, match="at most 512"):
        map_cache(identity_map(model.config, model.config), too_long, model)


def test_non_finite_mapping_is_refused(llama_family):
    model = load(llama_family.parent)
    s = kv_shape(model.config)
    bad = torch.full((s.width, s.width), float("nan"))
    layers = [LayerMap((i,), "map", bad, None, torch.eye(s.width), None, 1.0) for i in range(s.num_layers)]
    rope = RopeSpec.from_config(model.config)
    kv_map = LinearKVMap(layers, s, s, rope, rope)
    _, cache = prefill(model, _doc_ids(8))
    with pytest.raises(NonFiniteKVError, match="layer 0"):
        map_cache(kv_map, cache, model)


def test_content_space_identity_rerotates_keys(llama_family, theta_variant):
    """Pass-through in content space re-rotates keys for a target with another RoPE base."""
    a, b = load(llama_family.parent), load(theta_variant)
    s = kv_shape(a.config)
    kv_map = LinearKVMap([LayerMap((i,), "passthrough") for i in range(s.num_layers)], s, s,
                         RopeSpec.from_config(a.config), RopeSpec.from_config(b.config))
    ids = _doc_ids(16)
    _, cache_a = prefill(a, ids)
    _, cache_b = prefill(b, ids)
    mapped = cache_layers(map_cache(kv_map, cache_a, b))
    torch.testing.assert_close(mapped[0][0], cache_layers(cache_b)[0][0], atol=1e-5, rtol=1e-4)


def test_lowrank_form_equals_its_dense_matrix(llama_family):
    model = load(llama_family.parent)
    s = kv_shape(model.config)
    rope = RopeSpec.from_config(model.config)
    g = torch.Generator().manual_seed(0)

    def factors():
        return torch.randn(s.width, 3, generator=g) * 0.1, torch.randn(3, s.width, generator=g) * 0.1

    lowrank, dense = [], []
    for i in range(s.num_layers):
        (kd, ku), (vd, vu) = factors(), factors()
        kb, vb = torch.randn(s.width, generator=g), torch.randn(s.width, generator=g)
        low = LayerMap((i,), "map", None, kb, None, vb, 1.0, kd, ku, vd, vu, anchored=True)
        assert low.form == "lowrank"
        lowrank.append(low)
        dense.append(LayerMap((i,), "map", low.dense("k"), kb, low.dense("v"), vb, 1.0))
        torch.testing.assert_close(low.dense("k"), torch.eye(s.width) + kd @ ku)
    _, cache = prefill(model, _doc_ids(12))
    a = LinearKVMap(lowrank, s, s, rope, rope).apply(cache_layers(cache))
    b = LinearKVMap(dense, s, s, rope, rope).apply(cache_layers(cache))
    for (k, v), (k2, v2) in zip(a, b, strict=True):
        torch.testing.assert_close(k, k2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v2, atol=1e-5, rtol=1e-5)
    assert LinearKVMap(lowrank, s, s, rope, rope).num_parameters() < LinearKVMap(dense, s, s, rope, rope).num_parameters()


def test_complex_pair_path_equals_the_generic_path(tiny_mapping):
    """The fast key path (RoPE as complex pairs, weights in pair order) gives the generic path's result."""
    kv_map = tiny_mapping.mapping.kv_map
    source = load(tiny_mapping.family.parent)
    ids = torch.cat([_doc_ids(20, 5), _doc_ids(20, 6)])
    _, cache = prefill(source, ids)
    layers = cache_layers(cache)
    positions = torch.arange(40).view(2, 20) + torch.tensor([[0], [7]])  # per-row positions
    for pos in (None, positions):
        fast = kv_map.apply(layers, pos)
        slow = kv_map.apply(layers, pos, fast=False)
        for (k, v), (k2, v2) in zip(fast, slow, strict=True):
            torch.testing.assert_close(k, k2, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, v2, atol=1e-5, rtol=1e-5)
    half = kv_map.apply(layers, dtype=torch.bfloat16)
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in half)


def test_layers_reading_several_sources_map_alike_on_both_paths(llama_family):
    """Target layers that concatenate overlapping source layers (each source read by two of them) give the
    same K/V on the fast and generic paths, and V equals the concatenated inputs times the weights (the
    source layers each conversion holds are released as they go: see the next test)."""
    model = load(llama_family.parent)
    s = kv_shape(model.config)
    rope = RopeSpec.from_config(model.config)
    g = torch.Generator().manual_seed(3)
    layers = []
    for i in range(s.num_layers):
        sources = (i,) if i == 0 else (i - 1, i)
        p = len(sources) * s.width
        layers.append(LayerMap(sources, "map", torch.randn(p, s.width, generator=g) * 0.1, None,
                               torch.randn(p, s.width, generator=g) * 0.1, torch.randn(s.width, generator=g), 1.0))
    kv_map = LinearKVMap(layers, s, s, rope, rope)
    _, cache = prefill(model, _doc_ids(10))
    src = cache_layers(cache)
    fast, slow = kv_map.apply(src), kv_map.apply(src, fast=False)
    for i, ((k, v), (k2, v2)) in enumerate(zip(fast, slow, strict=True)):
        torch.testing.assert_close(k, k2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v2, atol=1e-5, rtol=1e-5)
        x = torch.cat([src[j][1].transpose(1, 2).reshape(10, s.width) for j in layers[i].sources], -1)
        want = (x @ layers[i].v_weight + layers[i].v_bias).view(1, 10, s.kv_heads, s.head_dim).transpose(1, 2)
        torch.testing.assert_close(v, want, atol=1e-5, rtol=1e-5)
    partial = kv_map.apply(src, only={1, 2})
    assert partial[0] == (None, None) and all(k is not None for k, _ in partial[1:3])
    torch.testing.assert_close(partial[2][0], fast[2][0])


def test_converted_source_layers_are_made_once_and_released_after_their_last_reader():
    from mappings.apply import _Sources

    made: list[tuple[str, int]] = []

    def convert(kind):
        return lambda i: made.append((kind, i)) or torch.full((2,), float(i))

    layers = [LayerMap((0,), "map"), LayerMap((0, 1), "map"), LayerMap((1, 2), "map"), LayerMap((2,), "map")]
    src = _Sources(convert("k"), convert("v"), layers, only=None)
    for ti, lm in src.walk():
        for i in lm.sources:
            assert src.keys(i)[0].item() == src.values(i)[0].item() == i
        later = {i for other in layers[ti + 1:] for i in other.sources}
        held = {i for _, i in src._held}
        assert held <= later | set(lm.sources)  # nothing is held that neither this layer nor a later one reads
    assert sorted(made) == [(k, i) for k in "kv" for i in range(3)] and src._held == {}
    # layers outside `only` are neither walked nor readers
    skipped = _Sources(convert("k"), convert("v"), layers, only={1})
    walked = []
    for ti, _ in skipped.walk():
        walked.append(ti)
        skipped.keys(0), skipped.values(1)
    assert walked == [1] and skipped._held == {}

def test_pair_order_index():
    from mappings.apply import pair_order_index

    assert pair_order_index(1, 4).tolist() == [0, 2, 1, 3]
    assert pair_order_index(2, 4, copies=2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15]


def test_exact_prefix_never_writes_into_the_source_cache(tiny_family):
    """A pass-through layer copies the source's K/V: making the mapped sinks exact leaves the source intact."""
    model = load(tiny_family.child)
    cfg = model.config
    shape = kv_shape(cfg)
    passthrough = LinearKVMap([LayerMap((i,), "passthrough") for i in range(shape.num_layers)], shape, shape,
                              RopeSpec.from_config(cfg), RopeSpec.from_config(cfg))
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    _, source, _ = forward_with_cache(load(tiny_family.parent), ids, None)
    before = [(k.clone(), v.clone()) for k, v in cache_layers(source)]
    mapped = map_cache(passthrough, source, model)
    assert exact_prefix(model, mapped, ids, 4) == 4
    for (k, v), (bk, bv) in zip(cache_layers(source), before, strict=True):
        assert torch.equal(k, bk) and torch.equal(v, bv)
    assert not torch.equal(cache_layers(mapped)[0][0][:, :, :4], before[0][0][:, :, :4])
