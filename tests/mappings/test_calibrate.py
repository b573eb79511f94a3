from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mappings.cache_io import cache_layers, forward_with_cache, prefill
from mappings.calibrate import (
    CalibrationConfig,
    CalibrationSettings,
    calibrate,
    corpus_digest,
    prepare_windows,
)
from mappings.capture import decoder_layers, kv_shape
from mappings.errors import CorpusTooSmallError, NonFiniteKVError, ShapeMismatchError, TokenizerMismatchError
from mappings.manifest import MAPPING_VERSION
from mappings.methods import METHODS
from tests.mappings.conftest import TOKENS, WINDOW, load, load_tokenizer

SETTINGS = CalibrationSettings(tokens=TOKENS, window=WINDOW)


def _check_valid_cache(mapping, source_path, target_path, document):
    """The mapped cache has the target's layout, the target runs on it, outputs are finite, generation works."""
    source, target = load(source_path), load(target_path)
    ids = load_tokenizer(target_path)(document, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :72]
    _, src_cache = prefill(source, ids[:, :64])
    mapped = mapping.map_cache(src_cache, target)
    shape = kv_shape(target.config)
    layers = cache_layers(mapped)
    assert len(layers) == shape.num_layers
    assert all(k.shape == (1, shape.kv_heads, 64, shape.head_dim) for k, _ in layers)
    logits, _, _ = forward_with_cache(target, ids[:, 64:], mapped)
    assert torch.isfinite(logits).all()
    out = target.generate(ids, cache=mapping.map_cache(src_cache, target), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 76


def test_manifest_describes_the_calibration(tiny_mapping, corpus):
    man = tiny_mapping.mapping.manifest
    layers = kv_shape(load(tiny_mapping.family.child).config).num_layers
    assert man.mapping_version == MAPPING_VERSION
    assert man.method.name == "anchored_kl"
    # fitted as a FamilyCache serves it: sinks exact (not fitted, exact when judged), values attention-weighted;
    # the stored statistics are the plain ones of every row, for refitting textbook baselines
    assert man.method.exact_sinks == 4 and man.method.value_weights == "attention" and man.heldout["exact_sinks"] == 4
    assert all(st.keys.n == st.values.n == TOKENS for st in tiny_mapping.mapping.stats)
    assert [e.target_layer for e in man.layer_plan] == list(range(layers))
    assert all(e.sources == [e.target_layer] for e in man.layer_plan)
    assert man.calibration.token_count == TOKENS and man.calibration.window == WINDOW
    assert man.calibration.heldout_from == "last corpus text (mpl-2.0.txt)"
    assert man.calibration.corpus_sha256 == corpus_digest([t for _, t in corpus])
    assert man.source.fingerprint["combined"] != man.target.fingerprint["combined"]
    assert man.source.rope["rope_type"] == "default"
    assert len(man.metrics) == layers
    for row in man.metrics:
        assert 0.5 < row.keys.cosine <= 1.0 and 0.5 < row.values.cosine <= 1.0
        assert row.attn_cosine is not None and row.identity_attn_cosine is not None
        tried = set(row.kl_by_option)
        assert tried <= {f"alpha={a:g}" for a in METHODS["anchored_kl"].alphas} | {"passthrough"}
        assert len(tried) >= 3 and row.kl == min(row.kl_by_option.values())


def test_selection_beats_source_reuse_on_heldout(tiny_mapping):
    """Measured: held-out KL of the selected map is 2-20x below reusing the source KV on every tiny family."""
    held = tiny_mapping.mapping.manifest.heldout
    assert held["kl"] <= held["kl_identity"]
    assert held["kl"] <= held["kl_default_alpha"] + 1e-9  # the sweep never ends worse than where it starts
    metrics = tiny_mapping.mapping.manifest.metrics
    mapped = sum(r.attn_cosine for r in metrics) / len(metrics)
    reused = sum(r.identity_attn_cosine for r in metrics) / len(metrics)
    assert mapped > reused


def test_identity_pair_is_exact(llama_family, corpus):
    mapping = calibrate(llama_family.parent, llama_family.parent, corpus, SETTINGS, progress=False)
    assert mapping.manifest.heldout["kl"] < 1e-8
    for lm in mapping.kv_map.layers:
        if lm.mode == "map":
            torch.testing.assert_close(lm.k_weight, torch.eye(lm.k_weight.shape[0]), atol=1e-4, rtol=0)
            torch.testing.assert_close(lm.v_weight, torch.eye(lm.v_weight.shape[0]), atol=1e-4, rtol=0)


def test_rope_base_difference_is_bridged(llama_family, theta_variant, corpus):
    """Same weights, RoPE base 10000 -> 1000: raw reuse is wrong, the content-space map is exact at layer 0."""
    mapping = calibrate(llama_family.parent, theta_variant, corpus, SETTINGS, progress=False)
    held = mapping.manifest.heldout
    assert held["kl_identity"] > 5e-4  # measured 1.3e-3
    assert held["kl"] < 0.1 * held["kl_identity"]  # measured 1.8e-5
    assert mapping.manifest.metrics[0].keys.cosine > 0.99999
    assert any("RoPE" in d for d in mapping.manifest.pair_differences)


def test_gqa_to_mha_and_depth_difference(llama_family, mha_variant, corpus, document):
    mapping = calibrate(llama_family.parent, mha_variant, corpus, SETTINGS, progress=False)
    man = mapping.manifest
    assert man.method.name == "ridge_kl"
    assert len(man.layer_plan) == 3 and all(len(e.sources) == 2 for e in man.layer_plan)
    w = mapping.kv_map.layers[0].k_weight
    assert w.shape == (2 * 2 * 16, 4 * 16)
    _check_valid_cache(mapping, llama_family.parent, mha_variant, document)


def test_head_size_difference(llama_family, head_dim_variant, corpus, document):
    mapping = calibrate(llama_family.parent, head_dim_variant, corpus, SETTINGS, progress=False)
    assert mapping.manifest.method.name == "ridge_kl"
    assert mapping.kv_map.layers[0].v_weight.shape == (2 * 16, 2 * 8)
    _check_valid_cache(mapping, llama_family.parent, head_dim_variant, document)
    with pytest.raises(ShapeMismatchError, match="identity"):
        calibrate(llama_family.parent, head_dim_variant, corpus, method="anchored", tokens=TOKENS, window=WINDOW,
                  progress=False)


def test_depth_difference_picks_the_matching_source_layers(llama_family, pruned_variant, corpus, document):
    """Target = parent without layer 2: its layers 0 and 1 are the parent's, and screening finds them."""
    mapping = calibrate(llama_family.parent, pruned_variant, corpus, SETTINGS, progress=False)
    plan = mapping.manifest.layer_plan
    assert mapping.manifest.method.name == "ridge_kl"  # depths differ: plain ridge by default
    assert plan[0].sources[0] == 0 and plan[1].sources[0] == 1
    assert plan[2].sources[0] in (2, 3)
    assert mapping.manifest.metrics[0].keys.cosine > 0.998  # layer 0 is the parent's own (ridge shrinks a little)
    assert mapping.manifest.heldout["kl"] < 0.01
    _check_valid_cache(mapping, llama_family.parent, pruned_variant, document)
    # two concatenated source layers: the complex-pair key path agrees with the generic one
    _, cache = prefill(load(llama_family.parent), torch.randint(3, 300, (1, 24)))
    fast = mapping.kv_map.apply(cache_layers(cache))
    slow = mapping.kv_map.apply(cache_layers(cache), fast=False)
    for (k, v), (k2, v2) in zip(fast, slow, strict=True):
        torch.testing.assert_close(k, k2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["ridge", "paper", "anchored", "perhead_rope", "lowrank"])
def test_every_named_method_calibrates(llama_family, corpus, method):
    mapping = calibrate(llama_family.parent, llama_family.child, corpus, SETTINGS, method=method, progress=False)
    assert mapping.manifest.method.name == method
    assert mapping.manifest.heldout["kl"] < mapping.manifest.heldout["kl_identity"] * 3
    lm = mapping.kv_map.layers[1]
    if METHODS[method].granularity == "head":
        assert float(lm.k_weight[:16, 16:].abs().max()) == 0.0  # block diagonal: heads do not mix


def test_heldout_error_selection(llama_family, corpus):
    spec = METHODS["anchored_kl"].model_copy(update={"name": "anchored_err", "selection": "error"})
    mapping = calibrate(llama_family.parent, llama_family.child, corpus, SETTINGS, method=spec, progress=False)
    assert mapping.manifest.method.selection == "error"
    assert all(len(r.kl_by_option) == len(spec.alphas) + 1 for r in mapping.manifest.metrics)


def test_in_memory_models_and_nan_kv(llama_family, corpus):
    source, tok = load(llama_family.parent), load_tokenizer(llama_family.parent)
    attn = decoder_layers(source)[1].self_attn

    def poison(_m, _i, output):
        return torch.full_like(output, float("inf"))

    handle = attn.k_proj.register_forward_hook(poison)
    try:
        with pytest.raises(NonFiniteKVError, match="keys of layer 1"):
            calibrate(source, llama_family.child, corpus, source_tokenizer=tok, tokens=TOKENS, window=WINDOW,
                      progress=False)
    finally:
        handle.remove()


def test_settings_keep_the_former_defaults_and_are_frozen():
    s = CalibrationSettings()
    assert (s.method, s.tokens, s.window, s.stride, s.heldout_fraction, s.max_heldout_windows, s.batch_size,
            s.screen_tokens, s.sweeps, s.exact_layers, s.device, s.dtype) == (
        "auto", 16384, 512, None, 0.125, 8, 4, 1024, 1, 0, "cpu", None)
    assert CalibrationConfig is CalibrationSettings  # the former name still works
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.tokens = 1  # type: ignore[misc]


def test_an_unknown_keyword_is_a_type_error_naming_the_settings():
    # refused before anything is loaded: the model folders do not exist
    with pytest.raises(TypeError, match=r"calibrate\(\) got an unexpected keyword argument 'tokenz'.*method, tokens, "):
        calibrate("no/such/source", "no/such/target", [], tokenz=1024)
    with pytest.raises(TypeError, match="CalibrationSettings, not dict"):
        calibrate("no/such/source", "no/such/target", [], {"tokens": 1024})  # type: ignore[arg-type]


def test_keywords_calibrate_as_the_settings_they_name(llama_family, corpus):
    """The keyword path is the settings object: the same fit, number for number."""
    by_settings = calibrate(llama_family.parent, llama_family.child, corpus,
                            dataclasses.replace(SETTINGS, method="ridge_kl"), progress=False)
    by_keywords = calibrate(llama_family.parent, llama_family.child, corpus, method="ridge_kl", tokens=TOKENS,
                            window=WINDOW, progress=False)
    a, b = by_settings.manifest, by_keywords.manifest
    assert a.layer_plan == b.layer_plan and a.heldout == b.heldout and a.metrics == b.metrics
    for x, y in zip(by_settings.kv_map.layers, by_keywords.kv_map.layers, strict=True):
        assert torch.equal(x.dense("k"), y.dense("k")) and torch.equal(x.dense("v"), y.dense("v"))


def test_tokenizer_mismatch_is_refused(llama_family, other_tokenizer_model, corpus):
    with pytest.raises(TokenizerMismatchError, match="vocabulary 300 vs 320"):
        calibrate(llama_family.parent, other_tokenizer_model, corpus, SETTINGS, progress=False)


def test_corpus_too_small(llama_family):
    tok = load_tokenizer(llama_family.parent)
    cfg = CalibrationSettings(tokens=TOKENS, window=WINDOW)
    with pytest.raises(CorpusTooSmallError, match="empty"):
        prepare_windows([], tok, cfg)
    with pytest.raises(CorpusTooSmallError, match="empty"):
        prepare_windows(["", "   "], tok, cfg)
    with pytest.raises(CorpusTooSmallError, match="lower --tokens"):
        prepare_windows(["just a few words of text"], tok, cfg)
    with pytest.raises(CorpusTooSmallError):
        calibrate(llama_family.parent, llama_family.child, ["short text"], tokens=TOKENS, window=WINDOW, progress=False)


def test_window_split_single_text(llama_family, corpus):
    tok = load_tokenizer(llama_family.parent)
    windows = prepare_windows([corpus[0][1]], tok, CalibrationSettings(tokens=512, window=64))
    assert windows.heldout_from == "tail of the corpus"
    assert len(windows.train) == 8 and len(windows.heldout) == 1
    train_ids = {tuple(w.tolist()) for w in windows.train}
    assert all(tuple(w.tolist()) not in train_ids for w in windows.heldout)


def test_overlapping_fitting_windows_never_touch_heldout_tokens(llama_family, corpus):
    tok = load_tokenizer(llama_family.parent)
    text = corpus[0][1]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    plain = prepare_windows([text], tok, CalibrationSettings(tokens=512, window=64, max_heldout_windows=2))
    strided = prepare_windows([text], tok, CalibrationSettings(tokens=len(ids), window=64, stride=32,
                                                             heldout_fraction=0.01, max_heldout_windows=2))
    assert len(strided.train) > len(ids) // 64  # more windows than the text holds without overlap
    assert len(strided.heldout) == 1
    held = strided.heldout[0].tolist()
    assert held == ids[len(ids) - 64 :]  # the held-out window is the text's tail
    assert all(w.tolist() != held for w in strided.train)
    assert len(plain.heldout) == 1


def test_short_corpus_falls_back_to_overlapping_windows(llama_family, corpus):
    tok = load_tokenizer(llama_family.parent)
    text = corpus[0][1]
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert prepare_windows([text], tok, CalibrationSettings(tokens=n // 2, window=64)).stride == 64
    auto = prepare_windows([text], tok, CalibrationSettings(tokens=int(n * 1.5), window=64, max_heldout_windows=1))
    assert auto.stride == 32 and len(auto.train) == math.ceil(n * 1.5 / 64)
    with pytest.raises(CorpusTooSmallError):
        prepare_windows([text], tok, CalibrationSettings(tokens=n * 8, window=64))


def test_grid_search_tries_every_option(llama_family, corpus):
    spec = METHODS["anchored_kl"].model_copy(update={"name": "anchored_grid", "search": "grid", "alphas": (0.1, 1.0)})
    mapping = calibrate(llama_family.parent, llama_family.child, corpus, SETTINGS, method=spec, progress=False)
    for row, entry in zip(mapping.manifest.metrics, mapping.manifest.layer_plan, strict=True):
        assert set(row.kl_by_option) == {"alpha=0.1", "alpha=1", "passthrough"}
        chosen = "passthrough" if entry.mode == "passthrough" else f"alpha={entry.alpha:g}"
        assert row.kl_by_option[chosen] == min(row.kl_by_option.values())


def test_local_search_finds_the_valley():
    from mappings.calibrate import _local_search

    grid = list(range(9))
    for valley in range(9):
        calls = []

        def cost(x, valley=valley, calls=calls):
            calls.append(x)
            return (x - valley) ** 2

        assert _local_search(grid, 5, cost) == valley
        assert len(set(calls)) <= abs(valley - 5) + 3
