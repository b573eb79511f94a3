"""The JSON parse / validate / repair policy, driven by a scripted generator (no model needed)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from agents import AgentSpec, OutputSpec, OutputValidationError, TruncatedOutputError, run_with_repairs
from agents.builtin import KeyFacts, key_facts
from agents.schema import schema_errors
from agents.structured import JsonObjectTracker, extract_json_object, parse_output


@dataclass
class Reply:
    text: str
    finish_reason: str = "eos"


class Script:
    """Returns canned replies in order and records the repair turns it was given."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = list(replies)
        self.calls: list[tuple[int, tuple]] = []

    def __call__(self, index, repairs):
        self.calls.append((index, tuple(repairs)))
        return self.replies[index]


def test_extract_first_object_amid_chatter_and_fences():
    text = 'Sure! {not json} ```json\n{"facts": ["a {b}", "c"]}\n``` and {"second": 1}'
    assert extract_json_object(text) == {"facts": ["a {b}", "c"]}
    assert extract_json_object("[1, 2] no object") is None
    assert extract_json_object('{"a": 1') is None


def test_tracker_sees_completion_and_truncation():
    tracker = JsonObjectTracker()
    assert not tracker.feed('Here: {"a": "}{", "b": {"c": 1')
    assert tracker.unfinished
    assert tracker.feed("}} trailing")
    assert not tracker.unfinished
    escaped = JsonObjectTracker()
    assert escaped.feed('{"q": "say \\"}\\" ok"}')


def test_valid_first_try_returns_model_instance():
    script = Script(Reply('{"facts": ["Revenue grew."]}'))
    out = run_with_repairs(key_facts(), script)
    assert out.attempts == 1 and out.value == KeyFacts(facts=["Revenue grew."])
    assert script.calls == [(0, ())]


def test_invalid_then_repaired():
    script = Script(Reply('{"facts": []}'), Reply('{"facts": ["ok"]}'))
    out = run_with_repairs(key_facts(max_repairs=2), script)
    assert out.attempts == 2 and out.value.facts == ["ok"]
    (_, first), (_, second) = script.calls
    assert first == ()
    assert len(second) == 1 and second[0].previous_output == '{"facts": []}'
    assert "facts" in second[0].instruction and "did not match" in second[0].instruction


def test_validation_error_after_bounded_retries_carries_raw_output_and_error():
    spec = key_facts(max_repairs=1)
    script = Script(Reply("no json here"), Reply('{"facts": "not a list"}'), Reply("never asked"))
    with pytest.raises(OutputValidationError) as info:
        run_with_repairs(spec, script)
    err = info.value
    assert len(script.calls) == 2
    assert err.attempts == 2 and err.raw_output == '{"facts": "not a list"}'
    assert "facts" in err.error and "not a list" in str(err)


def test_truncated_json_after_retries():
    spec = AgentSpec(name="j", task="t", output=OutputSpec(kind="json", max_repairs=1))
    script = Script(Reply('{"a": [1, 2', "length"), Reply('{"a": [1, 2, 3', "length"))
    with pytest.raises(TruncatedOutputError) as info:
        run_with_repairs(spec, script)
    assert info.value.attempts == 2 and info.value.raw_output.startswith('{"a"')
    assert "cut off" in script.calls[1][1][0].instruction
    # the same text that ended on EOS is a plain validation failure, not a truncation
    with pytest.raises(OutputValidationError) as info2:
        run_with_repairs(spec, Script(Reply('{"a": [1, 2', "eos"), Reply('{"a": [1', "eos")))
    assert not isinstance(info2.value, TruncatedOutputError)


def test_no_repairs_fails_immediately():
    spec = AgentSpec(name="j", task="t", output=OutputSpec(kind="json", max_repairs=0))
    script = Script(Reply("nothing"))
    with pytest.raises(OutputValidationError):
        run_with_repairs(spec, script)
    assert len(script.calls) == 1


def test_parse_output_schema_path():
    out = OutputSpec(kind="json", json_schema={"type": "object", "required": ["x"]})
    value, problem = parse_output('x {"x": 1}', out, "eos")
    assert value == {"x": 1} and problem is None
    value, problem = parse_output('{"y": 1}', out, "eos")
    assert value is None and "'x' is a required property" in problem.error


def test_schema_errors_check_every_keyword_of_the_draft_with_paths():
    schema = {
        "type": "object",
        "$defs": {"Item": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}},
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "maxItems": 2},
            "name": {"type": ["string", "null"], "maxLength": 3},
            "score": {"anyOf": [{"type": "integer"}, {"type": "string", "const": "n/a"}]},
        },
    }
    assert schema_errors({"items": [{"k": "a"}], "name": None, "score": 3}, schema) == []
    errors = schema_errors({"items": [{"k": "z"}, {}, {"k": "a"}], "name": "long", "score": 1.5}, schema)
    assert any(e.startswith("$.items[0].k: 'z' is not one of") for e in errors)
    assert any(e.startswith("$.items[1]: 'k' is a required property") for e in errors)
    assert any(e.startswith("$.items: ") and "too long" in e for e in errors)
    assert any(e.startswith("$.name: 'long' is too long") for e in errors)
    assert any(e.startswith("$.score: 1.5 is not valid under any of the given schemas") for e in errors)
    assert schema_errors(True, {"type": "integer"}) != []


@pytest.mark.parametrize(("schema", "good", "bad"), [
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1.5, 2),  # 2 matches both: oneOf means exactly one
    ({"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"}, "GP-3", "gp-3"),
    ({"type": "string", "format": "date"}, "2026-12-06", "6 Dec 2026"),
    ({"type": "string", "format": "email"}, "a@b.org", "not an address"),
    ({"type": "array", "uniqueItems": True}, [1, 2], [1, 1]),
    ({"type": "number", "multipleOf": 0.5}, 2.5, 2.3),
    ({"not": {"const": "unknown"}}, "GPL", "unknown"),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False}, ["a", 1],
     ["a", "b"]),
])
def test_schema_errors_enforce_the_keywords_a_hand_written_subset_left_out(schema, good, bad):
    assert schema_errors(good, schema) == []
    assert schema_errors(bad, schema) != []


def test_a_schema_is_refused_with_where_it_is_wrong_and_never_fetches_a_ref():
    from agents.schema import check_schema

    with pytest.raises(ValueError, match="invalid JSON schema at properties/n/type"):
        check_schema({"type": "object", "properties": {"n": {"type": "integr"}}})
    with pytest.raises(ValueError, match="only \\$ref inside the schema"):
        check_schema({"$ref": "https://example.com/schema.json"})
    check_schema({"$defs": {"A": {"type": "string"}}, "items": {"$ref": "#/$defs/A"}, "type": "array"})


def test_truncated_list_keeps_its_complete_items():
    from agents.builtin import key_facts
    from agents.structured import parse_output, salvage_truncated

    cut = '{"facts": ["The licence is free.", "You may copy it \\" verbatim.", "You may not'
    assert salvage_truncated(cut) == {"facts": ["The licence is free.", 'You may copy it " verbatim.']}
    assert salvage_truncated('{"facts": ["only one unfinished') is None
    value, problem = parse_output(cut, key_facts().output, "length")
    assert problem is None and value.facts[0] == "The licence is free."
    # a reply that ended by itself is not salvaged: an unclosed object there is a real error
    assert parse_output(cut, key_facts().output, "eos")[1] is not None


def test_a_repeated_item_is_dropped_not_fatal_and_counted():
    spec = key_facts(max_facts=4, grounded=False)
    fact = "This License applies to any program or other work which contains a notice."
    script = Script(Reply(json.dumps({"facts": [fact, fact.upper() + " "]})))
    out = run_with_repairs(spec, script)
    assert out.degenerate is None and out.attempts == 1 and out.duplicates_removed == 1
    assert isinstance(out.value, KeyFacts) and out.value.facts == [fact]


def test_repeats_stay_when_dropping_them_breaks_the_schema():
    schema = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string"}, "minItems": 2}},
              "required": ["names"]}
    spec = AgentSpec(name="pair", task="Two names.", output=OutputSpec(kind="json", json_schema=schema, max_repairs=0))
    out = run_with_repairs(spec, Script(Reply('{"names": ["Ada", "Ada"]}')))
    assert out.duplicates_removed == 0 and out.degenerate is not None  # all items the same: still degenerate
