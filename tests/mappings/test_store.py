from __future__ import annotations

import json
import shutil

import pytest
import torch

from mappings.cache_io import cache_layers, prefill
from mappings.errors import CorruptMappingError, StaleMappingError
from mappings.fingerprint import check_fingerprints, fingerprint_dir
from mappings.manifest import MANIFEST_FILE, MAPPING_VERSION, STATS_FILE, TENSORS_FILE
from mappings.store import Mapping, load_mapping, read_manifest
from tests.mappings.conftest import load


@pytest.fixture
def mapping_copy(tiny_mapping, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(tiny_mapping.path, out)
    return out


def test_roundtrip_gives_the_same_cache(tiny_mapping):
    fam = tiny_mapping.family
    loaded = load_mapping(tiny_mapping.path, fingerprint_dir(fam.parent), fingerprint_dir(fam.child), with_stats=True)
    assert loaded.manifest == tiny_mapping.mapping.manifest
    for a, b in zip(loaded.kv_map.layers, tiny_mapping.mapping.kv_map.layers, strict=True):
        assert a.mode == b.mode and a.sources == b.sources
        if a.mode == "map":
            torch.testing.assert_close(a.k_weight, b.k_weight)
            torch.testing.assert_close(a.v_bias, b.v_bias)
    source, target = load(fam.parent), load(fam.child)
    _, cache = prefill(source, torch.randint(3, 300, (1, 20)))
    for (k, v), (k2, v2) in zip(cache_layers(loaded.map_cache(cache, target)),
                                cache_layers(tiny_mapping.mapping.map_cache(cache, target)), strict=True):
        torch.testing.assert_close(k, k2)
        torch.testing.assert_close(v, v2)
    # the statistics survive too (so baselines can be refitted)
    assert loaded.stats is not None and len(loaded.stats) == len(loaded.kv_map.layers)
    torch.testing.assert_close(loaded.stats[0].keys.xtx, tiny_mapping.mapping.stats[0].keys.xtx)
    assert loaded.stats[0].keys.n == tiny_mapping.mapping.stats[0].keys.n


def test_directory_holds_only_safetensors_and_json(tiny_mapping):
    names = sorted(p.name for p in tiny_mapping.path.iterdir())
    assert names == sorted([MANIFEST_FILE, TENSORS_FILE, STATS_FILE])
    for name in (TENSORS_FILE, STATS_FILE):
        header_len = int.from_bytes((tiny_mapping.path / name).read_bytes()[:8], "little")
        header = json.loads((tiny_mapping.path / name).read_bytes()[8 : 8 + header_len])
        assert header["__metadata__"]["mapping_version"] == str(MAPPING_VERSION)


def test_cache_key_has_the_seed_fields(tiny_mapping):
    man = tiny_mapping.mapping.manifest
    key = man.cache_key()
    for field in ("source_fingerprint", "target_fingerprint", "source_rope", "target_rope", "runtime_dtype",
                  "mapping_version"):
        assert field in key
    assert key["runtime_dtype"] == "float32" and key["mapping_version"] == MAPPING_VERSION
    assert len(man.cache_key_digest()) == 64
    changed = man.model_copy(update={"mapping_version": MAPPING_VERSION + 1})
    assert changed.cache_key_digest() != man.cache_key_digest()


def test_stale_fingerprint_is_refused(tiny_mapping, llama_family, qwen2_family):
    fam = tiny_mapping.family
    other = qwen2_family if fam.arch != "qwen2" else llama_family
    with pytest.raises(StaleMappingError, match="another target model .*weights"):
        load_mapping(tiny_mapping.path, fingerprint_dir(fam.parent), fingerprint_dir(other.child))
    with pytest.raises(StaleMappingError, match="another source model"):
        load_mapping(tiny_mapping.path, source_fp=fingerprint_dir(fam.child))
    with pytest.raises(StaleMappingError):
        load_mapping(tiny_mapping.path, source_fp="0" * 64)
    manifest = read_manifest(tiny_mapping.path)  # the check itself, without loading tensors
    check_fingerprints(manifest, fingerprint_dir(fam.parent), manifest.target.fingerprint)
    with pytest.raises(StaleMappingError, match="another source model"):
        check_fingerprints(manifest, manifest.target.fingerprint)


def test_truncated_tensors_are_refused(mapping_copy):
    path = mapping_copy / TENSORS_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptMappingError, match="truncated or modified"):
        load_mapping(mapping_copy)


def test_modified_tensors_are_refused(mapping_copy):
    path = mapping_copy / TENSORS_FILE
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # same size, one flipped byte inside a weight
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptMappingError):
        load_mapping(mapping_copy)


def test_truncated_stats_are_refused(mapping_copy):
    path = mapping_copy / STATS_FILE
    path.write_bytes(path.read_bytes()[:100])
    load_mapping(mapping_copy)  # the map itself is fine
    with pytest.raises(CorruptMappingError):
        load_mapping(mapping_copy, with_stats=True)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_schema", "missing"])
def test_corrupt_manifest_is_refused(mapping_copy, damage):
    path = mapping_copy / MANIFEST_FILE
    text = path.read_text()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\xff\xfe\x00garbage")
    elif damage == "wrong_schema":
        data = json.loads(text)
        del data["layer_plan"]
        path.write_text(json.dumps(data))
    else:
        path.unlink()
    with pytest.raises(CorruptMappingError):
        load_mapping(mapping_copy)


def test_inconsistent_layer_plan_is_refused(mapping_copy):
    data = json.loads((mapping_copy / MANIFEST_FILE).read_text())
    data["layer_plan"] = data["layer_plan"][:-1]
    (mapping_copy / MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(CorruptMappingError, match="every target layer"):
        load_mapping(mapping_copy)


def test_other_mapping_version_is_stale(mapping_copy):
    data = json.loads((mapping_copy / MANIFEST_FILE).read_text())
    data["mapping_version"] = MAPPING_VERSION + 1
    (mapping_copy / MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(StaleMappingError, match="recalibrate"):
        read_manifest(mapping_copy)


def test_saving_without_stats(tiny_mapping, tmp_path):
    m = tiny_mapping.mapping
    out = Mapping(m.kv_map, m.manifest, m.stats).save(tmp_path / "nostats", with_stats=False)
    assert not (out / STATS_FILE).exists()
    loaded = load_mapping(out, with_stats=True)
    assert loaded.stats is None and loaded.manifest.stats is None
    assert loaded.manifest.tensors == m.manifest.tensors  # same bytes, same hash


def test_lowrank_mapping_roundtrip(llama_family, corpus, tmp_path):
    from mappings.calibrate import calibrate
    from mappings.methods import METHODS
    from tests.mappings.conftest import TOKENS, WINDOW

    spec = METHODS["lowrank"].model_copy(update={"rank": 4, "selection": "none"})
    mapping = calibrate(llama_family.parent, llama_family.child, corpus, method=spec, tokens=TOKENS, window=WINDOW,
                        progress=False)
    assert {e.form for e in mapping.manifest.layer_plan} == {"lowrank"}
    assert all(e.anchored for e in mapping.manifest.layer_plan)
    loaded = load_mapping(mapping.save(tmp_path / "low"))
    lm, lm2 = mapping.kv_map.layers[2], loaded.kv_map.layers[2]
    assert lm2.k_weight is None and lm2.k_down.shape == (32, 4)
    torch.testing.assert_close(lm2.dense("v"), lm.dense("v"))
    # the anchored correction has rank 4
    assert int(torch.linalg.matrix_rank(lm.dense("k") - torch.eye(32), atol=1e-5)) == 4
