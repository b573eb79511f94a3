"""Tokenizer compatibility is decided by what decides token ids, and a refusal names what differs."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mappings.compat import check_pair
from mappings.errors import TokenizerMismatchError
from mappings.fingerprint import token_ids_digest, tokenizer_digest
from mappings.tokenizer_compat import compare_tokenizers, first_difference, id_parts
from tests.mappings.conftest import load
from tests.tokenizer_variants import (
    save_edited_tokenizer,
    save_instruct_tokenizer,
    swap_ids,
    wordlevel_tokenizer,
)


def _tok(path: Path):
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def base(llama_family) -> Path:
    return llama_family.parent


def test_base_and_instruct_tokenizers_share_token_ids(base, tmp_path):
    instruct = _tok(save_instruct_tokenizer(base, tmp_path / "instruct"))
    source = _tok(base)
    assert instruct.eos_token == "<pad>" and instruct.chat_template  # really another eos and a template
    assert token_ids_digest(instruct) == token_ids_digest(source)
    diff = compare_tokenizers(instruct, source, names=("member instruct", "the source"))
    assert diff.same_ids and diff.problems == [] and diff.summary() == "same token ids"
    notes = "\n".join(diff.notes)
    assert "special-token role eos_token: '<pad>' vs '</s>'" in notes and "chat template: present vs none" in notes
    # the fingerprint's tokenizer part is the model's identity and keeps its meaning: stored mappings stay valid
    assert tokenizer_digest(instruct) != tokenizer_digest(source)


def test_swapped_token_ids_change_the_digest_and_are_named(base, tmp_path):
    swapped = _tok(save_edited_tokenizer(base, tmp_path / "swapped", swap_ids("Ġthe", "Ġa")))
    source = _tok(base)
    assert token_ids_digest(swapped) != token_ids_digest(source)
    diff = compare_tokenizers(swapped, source, names=("member swapped", "the source"))
    assert not diff.same_ids and diff.other_ids == 2
    message = diff.refusal("member swapped")
    assert message.startswith("member swapped's tokenizer differs from the source's: 2 tokens with other ids")
    assert "'Ġthe'" in message and "'Ġa'" in message and "vocabulary" not in message  # same size: not named
    assert message.endswith("members of one family must share a tokenizer") and "\n" not in message


def test_an_added_token_changes_the_digest_and_is_named(base):
    source, extra = _tok(base), _tok(base)
    extra.add_tokens(["<extra>"])
    assert token_ids_digest(extra) != token_ids_digest(source)
    diff = compare_tokenizers(extra, source, names=("member extra", "the source"))
    assert diff.summary() == "vocabulary 321 vs 320, added token '<extra>' (id 320) only in member extra"


def test_a_different_kind_of_tokenizer_is_refused_naming_the_vocabulary_sizes(base):
    diff = compare_tokenizers(wordlevel_tokenizer(), _tok(base), names=("member words", "the source"))
    summary = diff.summary()
    assert not diff.same_ids and summary.startswith("vocabulary 44 vs 320")
    assert "model WordLevel vs BPE" in summary and "pre-tokenizer Whitespace vs ByteLevel" in summary


def test_normalizer_and_merge_order_are_part_of_the_ids(base, tmp_path):
    def lowercase(state):
        state["normalizer"] = {"type": "Lowercase"}

    def reorder(state):
        merges = state["model"]["merges"]
        merges[0], merges[1] = merges[1], merges[0]

    source = _tok(base)
    lowered = _tok(save_edited_tokenizer(base, tmp_path / "lower", lowercase))
    assert compare_tokenizers(lowered, source).summary() == "normalizer Lowercase vs none"
    reordered = _tok(save_edited_tokenizer(base, tmp_path / "reorder", reorder))
    diff = compare_tokenizers(reordered, source)
    assert diff.merges_differ == 0 and diff.summary() == "merges in another order (first at rank 0)"
    assert token_ids_digest(reordered) != token_ids_digest(source)


def test_the_post_processor_and_decoder_are_notes_not_id_changes(base, tmp_path):
    def frame(state):  # add_special_tokens=True now adds a BOS, and ids decode without ByteLevel
        state["post_processor"] = {"type": "TemplateProcessing",
                                   "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                              {"Sequence": {"id": "A", "type_id": 0}}],
                                   "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                            {"Sequence": {"id": "B", "type_id": 1}}],
                                   "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
        state["decoder"] = None

    framed = _tok(save_edited_tokenizer(base, tmp_path / "framed", frame))
    diff = compare_tokenizers(framed, _tok(base))
    assert diff.same_ids
    assert any("post-processors differ" in n for n in diff.notes) and any("decoders differ" in n for n in diff.notes)


class _SlowTokenizer:
    """A pure-Python tokenizer (no backend): one id per character of a fixed alphabet."""

    def __init__(self, alphabet: str, upper: bool = False) -> None:
        self.vocab = {c: i for i, c in enumerate(alphabet)}
        self.upper = upper
        self.added_tokens_decoder: dict[int, str] = {}
        self.special_tokens_map: dict[str, str] = {}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        text = text.upper() if self.upper else text
        return {"input_ids": [self.vocab.get(c, 0) for c in text]}


def test_slow_tokenizers_fall_back_to_vocabulary_added_tokens_and_probe_ids():
    alphabet = "?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ "
    plain, upper = _SlowTokenizer(alphabet), _SlowTokenizer(alphabet, upper=True)
    assert id_parts(plain)["kind"] == "slow"
    assert token_ids_digest(plain) == token_ids_digest(_SlowTokenizer(alphabet))
    # one vocabulary, other rules in code: told apart by the probe's ids
    assert token_ids_digest(plain) != token_ids_digest(upper)
    assert not compare_tokenizers(plain, upper).same_ids


def test_check_pair_accepts_an_instruct_target_and_notes_the_harmless_differences(llama_family, tmp_path):
    instruct = _tok(save_instruct_tokenizer(llama_family.parent, tmp_path / "instruct"))
    card = check_pair(load(llama_family.parent), _tok(llama_family.parent), load(llama_family.child), instruct)
    assert card.tokenizer.startswith("same token ids") and "harmless: special-token role eos_token" in card.tokenizer


def test_check_pair_refuses_other_ids_with_the_one_line_message(llama_family, tmp_path):
    swapped = _tok(save_edited_tokenizer(llama_family.parent, tmp_path / "swapped", swap_ids("Ġthe", "Ġa")))
    with pytest.raises(TokenizerMismatchError, match=r"^the target's tokenizer differs from the source's: 2 tokens "
                                                     r"with other ids .* must share a tokenizer"):
        check_pair(load(llama_family.parent), _tok(llama_family.parent), load(llama_family.child), swapped)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


@pytest.mark.real_model
def test_smollm2_base_style_copy_shares_ids_and_a_foreign_tokenizer_is_refused(real_family, base, tmp_path):
    root = real_family.member_path("root")
    source = _tok(root)
    base_style = _tok(save_instruct_tokenizer(root, tmp_path / "smol-base", eos_token="<|endoftext|>",
                                              pad_token="<|endoftext|>", chat_template=None))
    diff = compare_tokenizers(base_style, source, names=("member base", "the source"))
    assert diff.same_ids and any("chat template: none vs present" in n for n in diff.notes)
    assert token_ids_digest(base_style) == token_ids_digest(source)
    foreign = compare_tokenizers(_tok(base), source, names=("member tiny", "the source"))
    assert foreign.refusal("member tiny").startswith("member tiny's tokenizer differs from the source's: "
                                                     "vocabulary 320 vs 49152")
