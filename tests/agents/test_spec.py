from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from agents import AgentSpec, GenerationSettings, OutputSpec, UnknownUpstreamError, escape_template
from agents.spec import MAX_NEW_TOKENS


class Verdict(BaseModel):
    ok: bool
    reasons: list[str]


def test_format_template_references_and_render():
    spec = AgentSpec(name="report", task="Merge {summarizer} and {key-facts}; again {summarizer}. {{literal}}")
    assert spec.required_inputs() == ("summarizer", "key-facts")
    text = spec.render_task({"summarizer": "S", "key-facts": {"facts": ["a"]}, "unused": "x"})
    assert text == 'Merge S and {"facts": ["a"]}; again S. {literal}'


def test_dollar_template_references_and_render():
    spec = AgentSpec(name="r", task="Use $summarizer and ${key-facts}, costs $$5 {not a ref}",
                     template_syntax="dollar")
    assert spec.required_inputs() == ("summarizer", "key-facts")
    assert spec.render_task({"summarizer": "S", "key-facts": "K"}) == "Use S and K, costs $5 {not a ref}"


def test_unknown_upstream_names_agent_missing_and_available():
    spec = AgentSpec(name="critic", task="Check {summary} and {facts}")
    with pytest.raises(UnknownUpstreamError) as info:
        spec.render_task({"summary": "s", "other": "o"})
    err = info.value
    assert err.agent == "critic" and err.missing == ("facts",) and err.available == ("other", "summary")
    assert "'facts'" in str(err) and "'critic'" in str(err) and "'other'" in str(err)


@pytest.mark.parametrize(
    "task, syntax",
    [
        ("Use {0}", "format"),
        ("Use {}", "format"),
        ("Use {a.b}", "format"),
        ("Use {a[0]}", "format"),
        ("Use {a!r}", "format"),
        ("Use {a:>10}", "format"),
        ("Unbalanced {a", "format"),
        ("Cost $5", "dollar"),
    ],
)
def test_invalid_templates_are_refused_at_construction(task, syntax):
    with pytest.raises(ValidationError) as info:
        AgentSpec(name="a", task=task, template_syntax=syntax)
    assert "agent 'a'" in str(info.value)


def test_names_and_settings_are_validated():
    with pytest.raises(ValidationError):
        AgentSpec(name="bad name", task="t")
    with pytest.raises(ValidationError):
        AgentSpec(name="a", task="t", extra_field=1)
    with pytest.raises(ValidationError):
        GenerationSettings(temperature=-1)
    with pytest.raises(ValidationError):
        GenerationSettings(top_p=0)
    with pytest.raises(ValidationError):
        GenerationSettings(stop=[""])
    assert GenerationSettings(stop="\n\n").stop == ("\n\n",)
    assert GenerationSettings().greedy and not GenerationSettings(temperature=0.7).greedy


def test_output_spec_consistency_and_import_path():
    with pytest.raises(ValidationError):
        OutputSpec(kind="text", model=Verdict)
    with pytest.raises(ValidationError):
        OutputSpec(kind="json", model=Verdict, json_schema={"type": "object"})
    with pytest.raises(ValidationError):
        OutputSpec(kind="json", json_schema={"type": "thing"})
    with pytest.raises(ValidationError):
        OutputSpec(kind="json", model="agents.builtin:NoSuchModel")
    spec = OutputSpec(kind="json", model="agents.builtin:KeyFacts")
    from agents.builtin import KeyFacts

    assert spec.model is KeyFacts
    assert spec.model_dump()["model"] == "agents.builtin:KeyFacts"
    assert "facts" in spec.format_instructions()


def test_spec_round_trips_through_json():
    spec = AgentSpec(name="facts", task="List facts from {summary}",
                     generation=GenerationSettings(max_new_tokens=32, stop=["END"], seed=3),
                     output=OutputSpec(kind="json", model="agents.builtin:KeyFacts", max_repairs=2))
    again = AgentSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    assert again.required_inputs() == ("summary",)


def test_output_validation_with_model_and_schema():
    assert OutputSpec(kind="json", model=Verdict).validate_value({"ok": True, "reasons": []}) == Verdict(
        ok=True, reasons=[])
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}, "required": ["n"],
              "additionalProperties": False}
    out = OutputSpec(kind="json", json_schema=schema)
    assert out.validate_value({"n": 2}) == {"n": 2}
    for bad in ({"n": 0}, {}, {"n": 1, "x": 1}, {"n": "1"}):
        with pytest.raises(ValueError):
            out.validate_value(bad)
    with pytest.raises(ValueError):
        OutputSpec(kind="json").validate_value([1, 2])


def test_with_generation_and_escape():
    spec = AgentSpec(name="a", task="t").with_generation(max_new_tokens=7)
    assert spec.generation.max_new_tokens == 7
    assert AgentSpec(name="a", task=f"Q: {escape_template('use {x}')}").render_task({}) == "Q: use {x}"
    assert escape_template("$5", "dollar") == "$$5"


@pytest.mark.parametrize("value", [-5, 0, MAX_NEW_TOKENS + 1, 10**8, 1e8])
def test_max_new_tokens_is_bounded_and_says_so(value):
    with pytest.raises(ValidationError) as info:
        GenerationSettings(max_new_tokens=value)
    assert f"max_new_tokens must be a whole number from 1 to {MAX_NEW_TOKENS}" in str(info.value)
    assert f"got {int(value)}" in str(info.value)


def test_max_new_tokens_bounds_are_in_the_schema():
    assert GenerationSettings(max_new_tokens=MAX_NEW_TOKENS).max_new_tokens == MAX_NEW_TOKENS == 32768
    schema = GenerationSettings.model_json_schema()["properties"]["max_new_tokens"]
    assert (schema["minimum"], schema["maximum"]) == (1, MAX_NEW_TOKENS)
    with pytest.raises(ValidationError, match="valid integer"):
        GenerationSettings(max_new_tokens=1.5)
