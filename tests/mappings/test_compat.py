from __future__ import annotations

import pytest

from mappings.compat import check_pair, compare_tokenizers
from mappings.errors import ShapeMismatchError, TokenizerMismatchError
from mappings.methods import METHODS, method_names, resolve_method
from tests.mappings.conftest import load, load_tokenizer


def test_same_family_card(tiny_family):
    card = check_pair(load(tiny_family.parent), load_tokenizer(tiny_family.parent),
                      load(tiny_family.child), load_tokenizer(tiny_family.child))
    assert card.identical_layout and card.same_rope and card.same_depth
    assert card.differences == []
    text = card.render()
    assert "kv heads" in text and "no differences to bridge" in text
    assert card.as_dict()["source"]["kv_heads"] == load(tiny_family.parent).config.num_key_value_heads


def test_bridgeable_differences_are_reported(llama_family, mha_variant, theta_variant):
    card = check_pair(load(llama_family.parent), load_tokenizer(llama_family.parent),
                      load(mha_variant), load_tokenizer(mha_variant))
    assert not card.same_kv_shape and not card.same_depth
    joined = "\n".join(card.differences)
    assert "depth 4 -> 3" in joined and "KV heads 2 -> 4" in joined
    assert "<- differs" in card.render()
    rope_card = check_pair(load(llama_family.parent), load_tokenizer(llama_family.parent),
                           load(theta_variant), load_tokenizer(theta_variant))
    assert rope_card.identical_layout and not rope_card.same_rope
    assert any("RoPE" in d and "1000.0" in d for d in rope_card.differences)


def test_different_tokenizers_are_refused_naming_the_difference(llama_family, other_tokenizer_model):
    diff = compare_tokenizers(load_tokenizer(other_tokenizer_model), load_tokenizer(llama_family.parent))
    assert not diff.same_ids and "vocabulary 300 vs 320" in diff.summary()
    with pytest.raises(TokenizerMismatchError, match="tokenizer differs from the source's: vocabulary 300 vs 320"):
        check_pair(load(llama_family.parent), load_tokenizer(llama_family.parent),
                   load(other_tokenizer_model), load_tokenizer(other_tokenizer_model))


def test_special_token_difference_is_noted_not_refused(llama_family):
    a = load_tokenizer(llama_family.parent)
    b = load_tokenizer(llama_family.parent)
    b.eos_token = "<pad>"
    diff = compare_tokenizers(a, b)
    assert diff.same_ids and any("special-token role eos_token" in n for n in diff.notes)


def test_method_resolution():
    assert resolve_method("auto", same_kv_shape=True, same_kv_heads=True).name == "anchored_kl"
    assert resolve_method("auto", same_kv_shape=False, same_kv_heads=False).name == "ridge_kl"
    assert resolve_method("auto", same_kv_shape=True, same_kv_heads=True, same_depth=False).name == "ridge_kl"
    assert set(method_names()) == {"auto", *METHODS}
    with pytest.raises(ShapeMismatchError, match="identity"):
        resolve_method("anchored", same_kv_shape=False, same_kv_heads=True)
    with pytest.raises(ShapeMismatchError, match="KV head counts"):
        resolve_method("paper", same_kv_shape=False, same_kv_heads=False)
    assert resolve_method("paper", same_kv_shape=False, same_kv_heads=True).granularity == "head"
    default = METHODS["anchored_kl"]
    assert default.rank_for(192) == 32 and default.rank_for(1024) == 171  # max(32, width / 6)
    assert METHODS["anchored_kl_full"].rank_for(192) is None
    with pytest.raises(ValueError, match="unknown method"):
        resolve_method("magic", same_kv_shape=True, same_kv_heads=True)
