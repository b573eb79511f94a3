from __future__ import annotations

from agents.builtin import KeyFacts, key_facts
from agents.grounding import ground_value, is_grounded, normalize
from agents.structured import run_with_repairs

DOC = ("This License applies to any program or other work which contains a notice.\n"
       "You may charge any price or no price for each copy that you convey.")


class _Gen:
    def __init__(self, text: str) -> None:
        self.text, self.finish_reason = text, "eos"


def test_normalised_verbatim_match():
    doc = normalize(DOC)
    assert is_grounded("this license applies to any program", doc)
    assert is_grounded("You may charge any price,  or no price", doc)  # punctuation / spaces / case
    assert not is_grounded("You may charge a fee for each copy", doc)
    assert not is_grounded("icense applies", doc)  # whole words only
    assert not is_grounded("  ", doc)


def test_ungrounded_items_are_dropped_and_reported():
    value, report = ground_value({"facts": ["You may charge any price", "The GPL was written in 1850"]}, DOC)
    assert value == {"facts": ["You may charge any price"]}
    assert (report.checked, report.grounded, report.ungrounded) == (2, 1, ["The GPL was written in 1850"])


def test_grounded_agent_repairs_when_nothing_is_grounded_then_drops():
    spec = key_facts(max_repairs=1)
    replies = iter(['{"facts": ["Invented fact one", "Invented fact two"]}',
                    '{"facts": ["This License applies to any program", "Made up"]}'])
    seen = []

    def attempt(index, repairs):
        seen.append(repairs)
        return _Gen(next(replies))

    out = run_with_repairs(spec, attempt, document=DOC)
    assert out.attempts == 2 and "word for word" in seen[1][0].instruction
    assert isinstance(out.value, KeyFacts) and out.value.facts == ["This License applies to any program"]
    assert out.grounding.grounded == 1 and out.grounding.ungrounded == ["Made up"]


def test_ungrounded_option_off_keeps_everything():
    spec = key_facts(grounded=False)
    out = run_with_repairs(spec, lambda i, r: _Gen('{"facts": ["Made up"]}'), document=DOC)
    assert out.value.facts == ["Made up"] and out.grounding is None


def test_repeated_items_are_said_once():
    value, report = ground_value({"facts": ["You may charge any price", "you may charge any price.",
                                            "This License applies to any program"]}, DOC)
    assert value == {"facts": ["You may charge any price", "This License applies to any program"]}
    assert (report.checked, report.grounded, report.repeated) == (2, 2, 1)


def test_document_sentences_are_whole_collapsed_and_unique():
    from agents.grounding import document_sentences

    doc = "Title\n\nThe licence is free,\n  for all users.  It is free.\nThe licence is free,\nfor all users."
    assert document_sentences(doc, min_chars=5) == ["Title", "The licence is free, for all users.", "It is free."]
    assert document_sentences(doc) == ["The licence is free, for all users."]  # headings and scraps left out


def test_grounded_schema_offers_only_document_sentences_and_bounds_lists():
    from agents.grounding import document_sentences, grounded_schema

    schema = KeyFacts.model_json_schema()
    limited = grounded_schema(schema, DOC, max_items=3)
    facts = limited["properties"]["facts"]
    assert facts["items"] == {"type": "string", "enum": document_sentences(DOC)} and facts["maxItems"] == 3
    assert grounded_schema(schema, None, max_items=2)["properties"]["facts"]["items"] == schema["properties"]["facts"]["items"]
    assert grounded_schema(schema, None) is None  # nothing to change


def test_grounded_grammar_decodes_only_document_sentences(llama_tiny):
    """On a tiny random model (which would write anything), every fact is a sentence of the document."""
    from agents import DocumentPrompt
    from agents.grounding import document_sentences
    from agents.runner import generate

    model, tokenizer = llama_tiny.model, llama_tiny.tokenizer  # 512 positions, ~1 token a character
    doc = "The licence is free for all. Copies may be sold."
    spec = key_facts(max_facts=2, max_new_tokens=60, max_repairs=0)
    ids = DocumentPrompt(doc).token_ids(tokenizer)
    result = generate(model, tokenizer, spec, prefix_ids=ids)
    assert result.parsed is not None, result.text
    assert 1 <= len(result.parsed.facts) <= 2
    assert set(result.parsed.facts) <= set(document_sentences(doc, min_chars=10)), result.parsed.facts
