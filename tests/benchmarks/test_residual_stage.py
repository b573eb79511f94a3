"""benchmarks/residual_stage.py: a stage adds its fitted error in content space; the fit finds a real relation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.benchmarks.conftest import load_script

HEADS, DIM, LAYERS = 2, 8, 2


@pytest.fixture(scope="module")
def rs():
    return load_script("residual_stage")


def _map(rs):
    """A dense identity map in content space on a tiny Llama layout (keys stripped and re-rotated)."""
    from transformers import LlamaConfig

    from mappings.apply import LayerMap, LinearKVMap
    from mappings.capture import kv_shape
    from mappings.rope import RopeSpec

    cfg = LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HEADS * DIM * 2, num_attention_heads=HEADS * 2,
                      num_key_value_heads=HEADS, head_dim=DIM, intermediate_size=32, vocab_size=64)
    eye = torch.eye(HEADS * DIM)
    layers = [LayerMap((i,), "map", k_weight=eye.clone(), v_weight=eye.clone()) for i in range(LAYERS)]
    shape, rope = kv_shape(cfg), RopeSpec.from_config(cfg)
    return LinearKVMap(layers, shape, shape, rope, rope)


def test_a_stage_adds_its_error_in_content_space_and_the_target_rotates_it(rs):
    plain = _map(rs)
    torch.manual_seed(0)
    width, t = HEADS * DIM, 12
    source = [(torch.randn(1, HEADS, t, DIM), torch.randn(1, HEADS, t, DIM)) for _ in range(LAYERS)]
    # the stage: a constant content-space offset on layer 1's keys, nothing on its values
    offset = torch.randn(width)
    stage = rs.Stage(1, torch.zeros(2 * width), torch.ones(2 * width), ("cross",), torch.zeros(2 * width, 1),
                     {"k": torch.cat([offset[None], torch.zeros(2 * width, width)]), "v": torch.zeros(1 + 2 * width, width)})
    staged = rs.StagedMap(**{f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)}, stages={1: stage})
    base, out = plain.apply(source), staged.apply(source)
    torch.testing.assert_close(out[0][0], base[0][0])  # layers without a stage are the plain map's
    torch.testing.assert_close(out[1][1], base[1][1])
    pos = torch.arange(t)
    expected = plain.target_rope.apply(offset.view(1, 1, HEADS, DIM).expand(1, t, HEADS, DIM)
                                       .transpose(1, 2).contiguous(), pos, seq_len=t)
    torch.testing.assert_close(out[1][0] - base[1][0], expected, atol=1e-5, rtol=1e-5)
    # an offset added after the rotation (the wrong space) differs from the rotated one at every position but 0
    assert not torch.allclose(expected[:, :, 1:], offset.view(1, 1, HEADS, DIM).transpose(1, 2).expand(1, HEADS, t - 1, DIM))


def test_the_stage_fit_finds_keys_that_depend_on_the_source_values(rs):
    plain = _map(rs)
    torch.manual_seed(1)
    width = HEADS * DIM
    mix = torch.randn(width, width) * 0.5

    def layer(rows):
        xk, xv = torch.randn(rows, width), torch.randn(rows, width)
        return [xk, xv, xk + xv @ mix, xv]  # target keys = source keys + a function of the source values

    train = [layer(400) for _ in range(LAYERS)]
    held = [layer(100) for _ in range(LAYERS)]
    stages, cuts = rs.fit_stages(plain, train, held, ("cross",), features=4)
    assert set(stages) == {0, 1}
    assert min(cuts) > 0.9  # the identity map's whole key error is the values' share; the stage removes it
    # values were already exact: their stage stays (near) zero
    f = stages[0].features(*held[0][:2])
    assert float((f @ stages[0].weights["v"]).abs().max()) < 1e-2


def test_table_reads_the_rows(rs):
    def row(label, kl, cut):
        split = {"kl": kl, "top1": 0.95, "tail_kl": kl * 0.9, "tail_top1": 0.96, "pure_kl": kl * 2}
        return {"variant": label, "stage_seconds": 30.0, "layers": 29, "cut": cut,
                **{k: split for k in ("test@3584", "dev@3584", "test@512", "dev@512")}}

    res = {"method": "anchored_kl", "features": 256, "calibration_seconds": 90.0,
           "rows": [row("shipped", 0.0119, []), row("cross", 0.0308, [0.2, 0.4])]}
    md = rs.markdown(res, "python benchmarks/residual_stage.py")
    assert "| shipped | - | 0.0119 / 0.950 | 0.0107 / 0.960 |" in md
    assert "| cross | 30% | 0.0308 / 0.950 |" in md
    assert "256 random gelu features" in md
