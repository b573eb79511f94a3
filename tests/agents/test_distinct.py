"""Grounded JSON replies that read: distinct items, a budget their JSON finishes in, whole sentences."""

from __future__ import annotations

import json

import torch

from agents.builtin import KeyFacts, key_facts
from agents.constrained import JsonConstraint
from agents.distinct import DistinctItems
from agents.finish import complete_text
from agents.grounding import document_sentences, grounded_reply_tokens, grounded_schema

DOC = ("The licence is free for all users. Copies may be sold at any price. "
       "Changes must be marked as changes. The author gives no warranty at all.")


def _stubborn_decode(constraint, tokenizer, vocab: int, wanted: str, steps: int = 400) -> str:
    """Decode under ``constraint`` with a 'model' that always wants to write ``wanted`` (and, off that path,
    prefers tokens by a fixed random order): the small model that writes its first fact again and again."""
    prefs = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    pieces = [tokenizer.decode([t]) for t in range(vocab)]
    ids: list[int] = []
    for _ in range(steps):
        text = tokenizer.decode(ids)
        logits = prefs.clone()
        if wanted.startswith(text):
            rest = wanted[len(text):]
            for t, piece in enumerate(pieces):
                if piece and rest.startswith(piece):
                    logits[t] += 100.0 + len(piece)
        constraint.mask(logits)
        token = int(torch.argmax(logits))
        ids.append(token)
        constraint.accept(token)
        if constraint.finished():
            break
    return tokenizer.decode(ids, skip_special_tokens=True)


def _grammar(tokenizer, vocab: int):
    schema = grounded_schema(KeyFacts.model_json_schema(), DOC, max_items=3)
    return JsonConstraint.for_tokenizer(tokenizer, schema, vocab_size=vocab, fixed_layout=True)


def test_grounded_items_stay_distinct_when_the_model_wants_one_sentence_thrice(llama_tiny):
    tokenizer, vocab = llama_tiny.tokenizer, llama_tiny.model.config.vocab_size
    first = document_sentences(DOC)[0]
    wanted = json.dumps({"facts": [first, first, first]}, indent=2)

    plain = json.loads(_stubborn_decode(_grammar(tokenizer, vocab), tokenizer, vocab, wanted))
    assert plain["facts"] == [first, first, first]  # the grammar alone lets the repeats through

    distinct = json.loads(_stubborn_decode(DistinctItems(_grammar(tokenizer, vocab), tokenizer, document_sentences(DOC)),
                                           tokenizer, vocab, wanted))
    facts = distinct["facts"]
    assert facts[0] == first
    assert len(facts) == 3 and len(set(facts)) == 3, facts
    assert set(facts) <= set(document_sentences(DOC))


def test_a_grounded_reply_budget_holds_its_longest_reply(llama_tiny):
    tokenizer = llama_tiny.tokenizer
    longest = sorted(document_sentences(DOC), key=lambda s: len(tokenizer.encode(s, add_special_tokens=False)))[-3:]
    reply = json.dumps({"facts": longest}, indent=2)
    budget = grounded_reply_tokens(tokenizer, KeyFacts.model_json_schema(), DOC, 3)
    assert budget >= len(tokenizer.encode(reply, add_special_tokens=False))


def test_a_grounded_agent_finishes_its_json_past_a_small_max_new_tokens(llama_tiny):
    """8 tokens hold no fact; the reply still finishes its JSON (the budget comes from the sentences asked)."""
    from agents import DocumentPrompt
    from agents.runner import generate

    model, tokenizer = llama_tiny.model, llama_tiny.tokenizer  # 512 positions, ~1 token a character
    doc = "Copies may be sold freely. All changes must be marked."
    result = generate(model, tokenizer, key_facts(max_facts=1, max_new_tokens=8, max_repairs=0),
                      prefix_ids=DocumentPrompt(doc).token_ids(tokenizer))
    assert result.finish_reason != "length", result.text
    assert json.loads(result.text)["facts"][0] in document_sentences(doc)
    assert json.loads(result.output_text()) == result.parsed.model_dump(mode="json")


def test_a_reply_cut_mid_sentence_is_shown_up_to_its_last_whole_sentence():
    cut = "The licence allows use. It covers works based on the Library. The license includes protection for users' or"
    assert complete_text(cut) == "The licence allows use. It covers works based on the Library."
    listed = "The main points are:\n\n1. Copies may be sold at any price.\n2. Changes are marked.\n3."
    assert complete_text(listed) == "The main points are:\n\n1. Copies may be sold at any price.\n2. Changes are marked."


def test_a_whole_reply_or_one_long_cut_sentence_is_kept():
    assert complete_text("It is version 2.0.") == "It is version 2.0."
    long_cut = "Short one. " + "This sentence goes on and on about the many terms of the licence without an end " * 2
    assert complete_text(long_cut) == long_cut
