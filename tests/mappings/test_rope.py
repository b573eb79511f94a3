from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from mappings.capture import capture_kv
from mappings.errors import UnsupportedModelError
from mappings.rope import RopeSpec, rope_parameters_of
from tests.mappings.conftest import load

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            num_hidden_layers=1, intermediate_size=32, vocab_size=50)
VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                 "long_factor": [2.0 + i for i in range(8)], "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("rope", sorted(VARIANTS))
@pytest.mark.parametrize("seq", [50, 200])  # 200 > max positions: dynamic/longrope switch frequencies
def test_apply_matches_transformers_rotary(rope, seq):
    cfg = LlamaConfig(rope_parameters=dict(VARIANTS[rope]), **BASE)
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, seq, 16), torch.arange(seq)[None])
    keys = torch.randn(2, 2, seq, 16)
    _, expected = apply_rotary_pos_emb(keys, keys, cos, sin)
    spec = RopeSpec.from_config(cfg)
    assert spec.rope_type == rope
    rotated = spec.apply(keys, torch.arange(seq))
    torch.testing.assert_close(rotated, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(spec.strip(rotated, torch.arange(seq)), keys, atol=2e-6, rtol=1e-5)


def test_round_trip_flat_and_batched_positions():
    spec = RopeSpec.from_config(LlamaConfig(rope_parameters=dict(VARIANTS["yarn"]), **BASE))
    flat = torch.randn(40, 2, 16)
    pos = torch.randint(0, 100, (40,))
    torch.testing.assert_close(spec.strip(spec.apply(flat, pos, seq_len=100), pos, seq_len=100), flat, atol=2e-6, rtol=0)
    batched = torch.randn(3, 2, 10, 16)
    bpos = torch.arange(30).view(3, 10)
    torch.testing.assert_close(spec.strip(spec.apply(batched, bpos), bpos), batched, atol=2e-6, rtol=0)
    # batched positions agree with per-row shared positions
    row = spec.apply(batched[1:2], bpos[1])
    torch.testing.assert_close(spec.apply(batched, bpos)[1:2], row)


def test_strip_changes_keys_and_scaling_is_undone():
    spec = RopeSpec.from_config(LlamaConfig(rope_parameters=dict(VARIANTS["yarn"]), **BASE))
    _, scaling = spec.frequencies(64)
    assert scaling != 1.0
    keys = torch.randn(1, 2, 8, 16)
    rotated = spec.apply(keys, torch.arange(8))
    assert not torch.allclose(rotated, keys)
    # position 0 has angle 0: only the attention scaling remains
    torch.testing.assert_close(rotated[:, :, 0], keys[:, :, 0] * scaling)


def test_partial_rotary_leaves_tail_untouched():
    cfg = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                      **BASE)
    spec = RopeSpec.from_config(cfg)
    keys = torch.randn(1, 2, 12, 16)
    rotated = spec.apply(keys, torch.arange(12))
    torch.testing.assert_close(rotated[..., 8:], keys[..., 8:])
    assert not torch.allclose(rotated[..., :8], keys[..., :8])
    torch.testing.assert_close(spec.strip(rotated, torch.arange(12)), keys, atol=2e-6, rtol=0)


def test_transformers4_config_style():
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0}, head_dim=16,
                          hidden_size=64, num_attention_heads=4)
    params = rope_parameters_of(old)
    assert params == {"rope_theta": 5e5, "factor": 4.0, "rope_type": "linear"}
    assert rope_parameters_of(SimpleNamespace(rope_theta=1e4, rope_scaling=None))["rope_type"] == "default"
    assert rope_parameters_of(SimpleNamespace(hidden_size=8)) is None


def test_no_rope_model_is_a_no_op():
    spec = RopeSpec.from_config(SimpleNamespace(hidden_size=64, num_attention_heads=4, max_position_embeddings=32))
    assert not spec.is_rotary
    keys = torch.randn(1, 4, 5, 16)
    assert spec.apply(keys, torch.arange(5)) is keys


def test_per_layer_type_rope_is_refused():
    nested = SimpleNamespace(rope_parameters={"full_attention": {"rope_theta": 1e4}, "sliding": {"rope_theta": 1e4}})
    with pytest.raises(UnsupportedModelError, match="per-layer-type"):
        rope_parameters_of(nested)


def test_cross_theta_keys_equal_those_of_the_other_model(llama_family, theta_variant):
    """strip(theta A) then apply(theta B) on model A's keys gives model B's keys when weights are equal."""
    model_a, model_b = load(llama_family.parent), load(theta_variant)
    ids = torch.randint(3, 300, (2, 40))
    cap_a, cap_b = capture_kv(model_a, ids), capture_kv(model_b, ids)
    rope_a, rope_b = RopeSpec.from_config(model_a.config), RopeSpec.from_config(model_b.config)
    assert not rope_a.same_as(rope_b)
    # Layer 0 sees identical inputs; later layers differ because attention itself differs.
    moved = rope_b.apply(rope_a.strip(cap_a.keys[0], cap_a.positions), cap_a.positions)
    torch.testing.assert_close(moved, cap_b.keys[0], atol=1e-5, rtol=1e-4)
    assert (cap_a.keys[0] - cap_b.keys[0]).abs().max() > 1e-3  # the bases really differ
    torch.testing.assert_close(cap_a.values[0], cap_b.values[0])
