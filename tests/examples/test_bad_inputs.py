"""Bad input through the Python API on the real family, where tests/agents (tiny models,
scripted outputs) and tests/orchestra leave a gap: a real model failing a schema or running out of
tokens mid-JSON inside a pipeline is that agent's own failure; its dependents are skipped and
every other agent still finishes."""

from __future__ import annotations

import pytest

from orchestra import AgentNode, Orchestra, PipelineError, PipelineSpec

# Nothing satisfies it: an integer both >= 10 and <= 5.
IMPOSSIBLE = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 5}},
              "required": ["n"], "additionalProperties": False}


def _json_agent(name: str, instructions: str, max_new_tokens: int, schema: dict | None = None) -> AgentNode:
    output = {"kind": "json", "max_repairs": 1, "instructions": instructions}
    if schema is not None:
        output["json_schema"] = schema
    return AgentNode(name=name, model="root", spec={
        "role": "You reply with JSON only.", "task": "Read the document.",
        "generation": {"max_new_tokens": max_new_tokens, "temperature": 0.0}, "output": output})


def test_template_reading_a_missing_agent_is_refused_before_any_model_loads():
    models = {"root": "root", "tuned": "finetuned"}
    review = AgentNode(name="review", model="tuned", builtin="critic", args={"target_agent": "summary"})
    # the critic's template reads {summary}: that agent is its upstream without being listed ...
    spec = PipelineSpec(models=models, source="root", agents=[AgentNode(name="summary", model="root",
                                                                        builtin="summarizer"), review])
    assert spec.upstreams()["review"] == ["summary"]
    # ... and a pipeline without it is refused when it is built, with what to use instead
    with pytest.raises(PipelineError, match=r"agent 'review'.*reads 'summary', which is not an agent.*agents: review"):
        PipelineSpec(models=models, source="root", agents=[review])


@pytest.mark.real_model
async def test_unsatisfiable_schema_and_truncated_json_fail_their_agents_only(real_family, short_document):
    spec = PipelineSpec(
        name="bad-json", models={"root": "root"}, source="root", default_device="cpu",
        agents=[
            _json_agent("count", 'Reply with only a JSON object like {"n": 3}.', 12, IMPOSSIBLE),
            _json_agent("facts", 'Reply with only a JSON object like {"facts": ["first fact", "second fact", '
                                 '"third fact"]} listing ten facts from the document.', 5),
            AgentNode(name="uses_count", model="root", upstream=["count"], spec={
                "task": "Explain {count}.", "generation": {"max_new_tokens": 4}}),
            AgentNode(name="fine", model="root", spec={
                "task": "Name the document in three words.", "generation": {"max_new_tokens": 6}}),
        ],
    )
    report = await Orchestra(spec, family=real_family).run(short_document)

    count = report.agent("count")
    assert count.status == "failed" and count.error_type == "OutputValidationError", count
    assert "after 2 attempt(s)" in count.error and "Simplify the schema" in count.error
    facts = report.agent("facts")
    assert facts.status == "failed" and facts.error_type == "TruncatedOutputError", facts
    assert "max_new_tokens=5" in facts.error and "raise generation.max_new_tokens" in facts.error
    skipped = report.agent("uses_count")
    assert skipped.status == "skipped" and "count" in skipped.skip_reason
    assert report.agent("fine").status == "succeeded" and report.agent("fine").output.strip()
