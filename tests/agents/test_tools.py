"""Agents that call tools: schemas from type hints, calls validated and run with a timeout, errors read by the agent."""

from __future__ import annotations

import json
import time

import pytest

from agents import AgentSpec
from agents.runner import _Generation, _tool_rounds
from agents.tools import Tool, ToolSchemaError, find, round_schema, run_tool, tool

DOC = "Grant of Copyright License.\n\nEach Contributor grants a licence.\n\nTrademarks. This License does not grant."


@tool(timeout_s=0.5)
def slow(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "woke"


@tool
def broken(x: int) -> str:
    """Always fails."""
    raise RuntimeError("the index is offline")


def test_a_tools_schema_comes_from_its_hints_and_docstring_and_leaves_the_document_out():
    assert find.name == "find" and find.description.startswith("The passages of the document")
    assert find.parameters["properties"] == {"text": {"title": "Text", "type": "string"}}
    assert "document" not in find.parameters["properties"]
    schema = round_schema([find, slow])
    assert [option["properties"].get("tool", {}).get("const") for option in schema["anyOf"]] == ["find", "slow", None]
    assert round_schema([find], must_call=True) == {"anyOf": schema["anyOf"][:1]}

    def untyped(text):  # no hint: no schema
        return text

    with pytest.raises(ToolSchemaError, match="parameter 'text' has no type hint"):
        Tool.of(untyped)
    with pytest.raises(ToolSchemaError, match="cannot import tool 'nosuch:fn'"):
        Tool.of("nosuch:fn")
    assert Tool.of("agents.tools:find").call == "agents.tools:find"


def test_calls_are_validated_run_and_their_failures_are_text_for_the_agent():
    ok = run_tool([find], "find", {"text": "trademarks"}, document=DOC, round=0)
    assert ok.ok and "Trademarks. This License" in ok.result
    bad = run_tool([find], "find", {"text": 3, "extra": 1}, document=DOC, round=0)
    assert not bad.ok and bad.result.startswith("error: bad arguments")
    unknown = run_tool([find], "search", {}, document=DOC, round=0)
    assert not unknown.ok and "there is no tool 'search'" in unknown.result
    failed = run_tool([broken], "broken", {"x": 1}, document=DOC, round=1)
    assert not failed.ok and "RuntimeError: the index is offline" in failed.result and failed.round == 1
    timed = run_tool([slow], "slow", {"seconds": 5}, document=DOC, round=0)
    assert not timed.ok and "did not answer within 0.5 s" in timed.result and timed.seconds < 3


class Rounds:
    """Scripted rounds: records the turns each round saw."""

    def __init__(self, *replies: str) -> None:
        self.replies, self.seen = list(replies), []

    def __call__(self, index, round_spec, turns):
        self.seen.append((round_spec.output.json_schema, [t.instruction for t in turns]))
        return _Generation(text=self.replies[index], finish_reason="eos")


class _Cut:
    """Rounds whose first reply stopped at max_new_tokens."""

    def __init__(self, rounds: Rounds) -> None:
        self.rounds = rounds

    def __call__(self, index, round_spec, turns):
        generation = self.rounds(index, round_spec, turns)
        return _Generation(text=generation.text, finish_reason="length" if index == 0 else "eos")


def test_the_tool_loop_appends_each_result_and_ends_at_the_answer_or_the_round_limit():
    spec = AgentSpec(name="qa", task="Who owns the trademarks?", tools=[find, broken], max_tool_rounds=2)
    rounds = Rounds(json.dumps({"tool": "find", "arguments": {"text": "trademarks"}}),
                    json.dumps({"tool": "broken", "arguments": {"x": 2}}),
                    json.dumps({"answer": "Nobody is granted them."}))
    result, calls = _tool_rounds(spec, rounds, DOC)
    assert result.text == "Nobody is granted them." and [c.name for c in calls] == ["find", "broken"]
    assert rounds.seen[1][1] == [f"Result of find: {calls[0].result}"]
    assert "the index is offline" in rounds.seen[2][1][1]
    assert "anyOf" not in rounds.seen[2][0]  # the last round may only answer
    cut = Rounds('{"answer": "The licence does not grant trade')  # max_new_tokens inside the answer
    result, calls = _tool_rounds(spec, cut, DOC)
    assert result.text == "The licence does not grant trade" and calls == []
    cut_call = Rounds('{"tool": "find", "arguments": {"text": "trade', json.dumps({"answer": "None."}))
    result, calls = _tool_rounds(spec, _Cut(cut_call), DOC)
    assert result.text == "None." and not calls[0].ok and "cut off" in calls[0].result


def test_an_agent_with_tools_calls_find_under_the_grammar_and_answers_on_the_real_model(smollm_root):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agents import DocumentPrompt
    from agents.runner import generate

    tokenizer = AutoTokenizer.from_pretrained(smollm_root)
    model = AutoModelForCausalLM.from_pretrained(smollm_root, dtype=torch.float32).eval()
    prefix = DocumentPrompt(DOC).token_ids(tokenizer)
    spec = AgentSpec(name="qa", task="Does the licence grant trademark rights? Look it up first.", tools=[find],
                     tool_choice="required", max_tool_rounds=1, generation={"max_new_tokens": 48})
    result = generate(model, tokenizer, spec, prefix_ids=prefix)
    assert len(result.tool_calls) == 1  # required first, then the round limit: one call, then the answer
    call = result.tool_calls[0]
    assert call.name == "find" and call.ok and 0 < len(call.arguments["text"]) <= 80  # the grammar: a whole call
    assert call.result.startswith(("no passage contains", "Grant", "Each", "Trademarks"))
    assert result.text and not result.text.lstrip().startswith('{"tool"')  # the last round is the answer


def test_tools_are_for_text_agents_with_distinct_names():
    with pytest.raises(ValueError, match="answers in text"):
        AgentSpec(name="qa", task="x", tools=[find], output={"kind": "json", "json_schema": {"type": "object"}})
    with pytest.raises(ValueError, match="share a name"):
        AgentSpec(name="qa", task="x", tools=[find, find])
