from __future__ import annotations

import pytest
import torch

from orchestra.family._quantize import quantize_dequantize, quantize_linear_layers


def test_each_group_uses_at_most_2_to_the_bits_levels_and_error_is_bounded():
    torch.manual_seed(0)
    w = torch.randn(8, 256)
    q = quantize_dequantize(w, bits=4, group_size=128)
    groups_w = w.view(8, 2, 128)
    groups_q = q.view(8, 2, 128)
    for r in range(8):
        for g in range(2):
            levels = torch.unique(groups_q[r, g])
            assert len(levels) <= 16
            scale = groups_w[r, g].abs().max() / 7
            assert (groups_w[r, g] - groups_q[r, g]).abs().max() <= scale / 2 + 1e-6
    assert not torch.equal(q, w)


def test_symmetric_grid_keeps_zero_and_sign():
    w = torch.tensor([[0.0, 1.0, -1.0, 0.5] * 32])
    q = quantize_dequantize(w, bits=4, group_size=128)
    assert q[0, 0] == 0.0
    assert torch.all(torch.sign(q[0, 1:4]) == torch.sign(w[0, 1:4]))


def test_group_size_must_divide_input_features():
    with pytest.raises(ValueError, match="multiple of group size"):
        quantize_dequantize(torch.randn(4, 100), bits=4, group_size=128)


def test_only_decoder_linear_layers_are_quantized(tiny_family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_family.parent)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # tiny models have 64/96 input features: use a group that divides both
    changed = quantize_linear_layers(model, bits=3, group_size=32)
    after = model.state_dict()
    assert changed == 7 * model.config.num_hidden_layers
    assert torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    q = after["model.layers.0.self_attn.q_proj.weight"]
    assert len(torch.unique(q.view(q.shape[0], -1, 32)[0, 0])) <= 8


def test_int8_per_channel_has_one_scale_per_output_row():
    torch.manual_seed(0)
    w = torch.randn(6, 576)
    w[3] *= 100.0  # a loud channel must not coarsen the others' grid (it would with one scale per tensor)
    q = quantize_dequantize(w, bits=8, group_size=None)
    for r in range(6):
        scale = w[r].abs().max() / 127
        levels = torch.round(q[r] / scale)
        assert torch.allclose(levels * scale, q[r], atol=1e-6 * float(scale))  # on this row's own grid
        assert levels.abs().max() == 127  # the row's largest weight sets its scale and is kept exactly
        assert len(torch.unique(levels)) <= 255
        assert (w[r] - q[r]).abs().max() <= scale / 2 + 1e-6
    quiet_err = (w[0] - q[0]).abs().max()
    assert quiet_err <= w[0].abs().max() / 127 / 2 + 1e-6
    assert quiet_err < (w[3] - q[3]).abs().max() / 20


def test_int8_is_far_closer_than_4bit():
    torch.manual_seed(1)
    w = torch.randn(64, 576) * 0.02
    err8 = (quantize_dequantize(w, 8, None) - w).pow(2).mean()
    err4 = (quantize_dequantize(w, 4, 64) - w).pow(2).mean()
    assert err8 < err4 / 50


def test_per_channel_quantization_of_decoder_layers(tiny_family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_family.parent)
    before = model.state_dict()["model.layers.1.mlp.up_proj.weight"].clone()
    assert quantize_linear_layers(model, bits=8, group_size=None) == 7 * model.config.num_hidden_layers
    after = model.state_dict()["model.layers.1.mlp.up_proj.weight"]
    scale = before.abs().amax(dim=1, keepdim=True) / 127
    assert not torch.equal(before, after)
    assert ((before - after).abs() <= scale / 2 + 1e-7).all()
