"""Residual-stream maps: fitted, stored with the mapping, and used to start layer repair."""

from __future__ import annotations

import json

import pytest
import torch

from mappings.cache_io import cache_layers, forward_with_cache
from mappings.calibrate_repair import add_residual_maps
from mappings.errors import CorruptMappingError
from mappings.repair import RepairPolicy, layer_scores, repair_cache
from mappings.store import load_mapping
from tests.mappings.conftest import TOKENS, WINDOW, load


@pytest.fixture(scope="module")
def repaired_mapping(llama_family, corpus, tmp_path_factory):
    from mappings.calibrate import calibrate

    mapping = calibrate(llama_family.parent, llama_family.child, corpus, tokens=TOKENS, window=WINDOW, progress=False)
    add_residual_maps(mapping, llama_family.parent, llama_family.child, corpus, tokens=TOKENS, window=WINDOW)
    out = tmp_path_factory.mktemp("repair_map")
    mapping.save(out)
    return mapping, out


def test_residual_maps_beat_the_unchanged_source_state(repaired_mapping):
    mapping, _ = repaired_mapping
    info = mapping.manifest.repair
    assert info is not None and info.residual is not None
    n = mapping.kv_map.target_shape.num_layers
    assert len(info.layer_scores) == len(info.residual_cosine) == n
    assert info.layer_scores == layer_scores(mapping.manifest)
    for i, (cos, ident) in enumerate(zip(info.residual_cosine, info.residual_identity_cosine, strict=True)):
        assert cos >= ident - 1e-3, f"layer {i}: mapped {cos:.4f} < unchanged {ident:.4f}"
    assert info.residual_cosine[0] > 0.99  # layer 0's input is the embedding, barely changed by fine-tuning
    assert info.blocks["1"] and all(z - a == int(k) for k, ((a, z),) in info.blocks.items())


def test_round_trip_and_corruption(repaired_mapping, llama_family):
    mapping, out = repaired_mapping
    loaded = load_mapping(out)
    assert loaded.residual is not None and len(loaded.residual.layers) == len(mapping.residual.layers)
    x = torch.randn(3, mapping.residual.source_width)
    torch.testing.assert_close(loaded.residual.apply(2, x), mapping.residual.apply(2, x))
    raw = (out / "residual.safetensors").read_bytes()
    (out / "residual.safetensors").write_bytes(raw[: len(raw) // 2])
    try:
        with pytest.raises(CorruptMappingError, match="residual"):
            load_mapping(out)
    finally:
        (out / "residual.safetensors").write_bytes(raw)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["repair"]["residual"]["name"] == "residual.safetensors"


def test_layer_repair_from_mapped_hidden_states(repaired_mapping, llama_family, document):
    """A block recomputed from residual-mapped hidden states lands closer to the truth than the KV map."""
    mapping, _ = repaired_mapping
    parent, child = load(llama_family.parent), load(llama_family.child)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_family.child))
    ids = torch.tensor(tok(document)["input_ids"][:64])[None]
    _, src_cache, src_out = forward_with_cache(parent, ids, None, output_hidden_states=True)
    _, true_cache, _ = forward_with_cache(child, ids, None)
    true = list(cache_layers(true_cache))
    mapped = mapping.kv_map.apply(list(cache_layers(src_cache)))
    hidden = dict(enumerate(src_out.hidden_states[:-1]))
    res = repair_cache(child, mapped, ids, RepairPolicy(budget=0.5, sink_tokens=0, layer_share=1.0, blocks=((1, 3),)),
                       residual=mapping.residual, source_hidden=hidden)
    for i in (1, 2):
        err_map = (mapped[i][1] - true[i][1]).norm()
        err_rep = (res.layers[i][1] - true[i][1]).norm()
        assert err_rep < err_map, f"layer {i}: repaired {err_rep:.4f} vs mapped {err_map:.4f}"
    assert torch.equal(res.layers[3][0], mapped[3][0])
