from __future__ import annotations

import pytest
import torch

from agents.continuation import TokenStream
from agents.sampling import Sampler
from agents.spec import GenerationSettings
from tests.tiny_family import make_tokenizer


def test_no_repeat_ngram_bans_the_token_that_would_repeat_a_phrase():
    sampler = Sampler(no_repeat_ngram_size=3)
    logits = torch.zeros(10)
    logits[7] = 5.0
    history = [1, 2, 7, 4, 1, 2]  # "1 2 7" already occurred: after "1 2", 7 is banned
    assert sampler(sampler.adjust(logits, history)) != 7
    assert sampler(sampler.adjust(logits, [1, 2, 7, 4, 1, 3])) == 7
    assert sampler.adjust(logits, history) is not logits and logits[7] == 5.0  # the model's logits untouched


def test_repetition_penalty_only_touches_generated_tokens():
    sampler = Sampler(repetition_penalty=2.0)
    logits = torch.tensor([4.0, 3.0, -1.0, 0.5])
    out = sampler.adjust(logits, [0, 2])
    assert out.tolist() == [2.0, 3.0, -2.0, 0.5]
    assert sampler(out) == 1
    assert Sampler().adjust(logits, [0]) is logits  # off by default (the server's OpenAI semantics)


def test_settings_carry_repetition_control_and_validate():
    s = GenerationSettings(repetition_penalty=1.2, no_repeat_ngram_size=4, seed=3)
    sampler = Sampler.from_settings(s, seed_offset=2)
    assert (sampler.repetition_penalty, sampler.no_repeat_ngram_size, sampler.seed) == (1.2, 4, 5)
    with pytest.raises(ValueError):
        GenerationSettings(repetition_penalty=0.5)


def test_token_stream_applies_repetition_control():
    tok = make_tokenizer()
    vocab = len(tok)
    favourite = 10
    plain = TokenStream(tok, frozenset(), max_new_tokens=4)
    banned = TokenStream(tok, frozenset(), max_new_tokens=4, no_repeat_ngram_size=1)
    for stream in (plain, banned):
        for _ in range(4):
            logits = torch.zeros(vocab)
            logits[favourite] = 3.0
            logits[favourite + 1] = 2.0
            stream.push(logits)
    assert plain.ids == [favourite] * 4
    assert banned.ids[:2] == [favourite, favourite + 1] and len(set(banned.ids)) == 4
