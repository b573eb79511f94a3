"""benchmarks/map_memory.py: the measurement on a tiny model with a dense map, and the table that reads it."""

from __future__ import annotations

import statistics

import pytest
import torch

from tests.benchmarks.conftest import load_script


@pytest.fixture(scope="module")
def mm():
    return load_script("map_memory")


def _dense_map(model):
    from mappings.apply import LayerMap, LinearKVMap
    from mappings.capture import kv_shape
    from mappings.rope import RopeSpec

    s, rope = kv_shape(model.config), RopeSpec.from_config(model.config)
    g = torch.Generator().manual_seed(0)
    layers = [LayerMap((i,), "map", torch.randn(s.width, s.width, generator=g), torch.randn(s.width, generator=g),
                       torch.randn(s.width, s.width, generator=g), None, 1.0) for i in range(s.num_layers)]
    layers[0] = LayerMap((0,), "passthrough")  # pass-through layers have no products
    return LinearKVMap(layers, s, s, rope, rope), s


def test_measure_reports_each_repetition_and_the_products_floor(mm, tiny_root):
    from tests.mappings.conftest import load
    from tests.tiny_family import build_tiny_family

    model = load(build_tiny_family(tiny_root, "llama").parent)
    kv_map, shape = _dense_map(model)
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    out = mm.measure(model, model, kv_map, ids, repeats=2)
    assert out["tokens"] == 40 and len(out["repeats"]) == 2
    assert out["products"] == 2 * (shape.num_layers - 1)  # a key and a value product per mapped layer
    assert out["cache_mb"] == pytest.approx(2 * shape.width * shape.num_layers * 40 * 4 / 2**20)
    for rep in out["repeats"]:
        assert rep["map_cold_s"] > 0 and rep["map_warm_faults"] >= 0 and rep["target_prefill_s"] > 0
    assert out["speedup_cold"] == pytest.approx(statistics.median(r["target_prefill_s"] / r["map_cold_s"]
                                                                  for r in out["repeats"]))
    assert out["products_s"] > 0 and out["speedup_products"] == out["median_target_prefill_s"] / out["products_s"]


def test_table_reads_the_results(mm):
    row = {"member": "finetuned", "tokens": 4096, "median_target_prefill_s": 9.5, "median_map_cold_s": 0.25,
           "median_map_cold_faults": 70000, "speedup_cold": 38.0, "median_map_warm_s": 0.12,
           "median_map_warm_faults": 0, "speedup_warm": 79.2, "products_s": 0.108, "speedup_products": 88.0,
           "cache_mb": 180.0}
    md = mm.markdown([row, {**row, "member": "passthrough", "products_s": 0.0, "speedup_products": None}], "cmd")
    assert "| finetuned | 4096 | 9.50 | 0.250 | 70,000 | 38x | 0.120 | 0 | 79x | 0.108 | 88x | 180 |" in md
    assert "| passthrough | 4096 |" in md and "| 0.000 | - |" in md
