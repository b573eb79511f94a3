"""The official `openai` client against a live `orchestra serve` on the bundled family (one server per module).

The server runs as users run it (`python -m orchestra serve ...` in a subprocess, 127.0.0.1, a free port, CPU),
with a Bearer key, one generation slot and no queue (so a second concurrent request is a 429), a small body
limit and a max_tokens cap. The document is a ~400-token slice of a bundled licence text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from orchestra.family.corpus import data_text
from tests.orchestra.serve.conftest import ROOT, LiveServer, start_server
from tests.waiting import HANG_GUARD_S

pytestmark = pytest.mark.real_model

KEY_ENV, KEY = "ORCHESTRA_TEST_SERVE_KEY", "test-key-123"
DOCUMENT = data_text("apache-2.0.txt")[:1800]


@pytest.fixture(scope="module")
def server(real_family, tmp_path_factory):
    live = start_server(real_family.home, tmp_path_factory.mktemp("serve") / "server.log",
                        "--api-key-env", KEY_ENV, "--max-concurrent", "1", "--max-queue", "0",
                        "--max-body-mb", "0.25", "--max-tokens-limit", "64", "--cache-mb", "768",
                        env={KEY_ENV: KEY})
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=HANG_GUARD_S)


def conversation(instruction: str, question: str) -> list[dict]:
    return [{"role": "system", "content": f"{instruction}\n\n{DOCUMENT}"}, {"role": "user", "content": question}]


def test_models_are_the_family_members(client):
    models = {m.id: m for m in client.models.list()}
    assert {"root", "finetuned", "quantized", "distilled"} <= set(models)
    finetuned = client.models.retrieve("finetuned")
    assert finetuned.model_extra["parent"] == "root" and finetuned.model_extra["divergence"]["kl"] > 0


def test_non_streamed_and_streamed_replies_agree(client):
    messages = conversation("Answer questions about this licence.", "What is this document?")
    raw = client.chat.completions.with_raw_response.create(model="root", messages=messages, max_tokens=8,
                                                           temperature=0)
    completion = raw.parse()
    text = completion.choices[0].message.content
    assert text and completion.choices[0].finish_reason in ("stop", "length")
    assert completion.object == "chat.completion" and completion.model == "root"
    assert 300 < completion.usage.prompt_tokens < 700 and 0 < completion.usage.completion_tokens <= 8
    assert raw.headers["x-orchestra-cache"] == "exact"

    chunks = list(client.chat.completions.create(model="root", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == completion.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == completion.usage.completion_tokens
    # the same prompt again: everything but the last prompt token comes from the cache
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_changing_model_mid_conversation_maps_the_cache(client):
    messages = conversation("You are a careful reader of licences.", "Who may use the work?")
    first = client.chat.completions.create(model="root", messages=messages, max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And what must they keep?"}]
    raw = client.chat.completions.with_raw_response.create(model="finetuned", messages=messages, max_tokens=8,
                                                           temperature=0)
    second = raw.parse()
    assert raw.headers["x-orchestra-cache"] == "mapped", dict(raw.headers)
    assert raw.headers["x-orchestra-cache-source"] == "root"
    assert "fail" not in raw.headers["x-orchestra-gates"]
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached == int(raw.headers["x-orchestra-cached-tokens"])
    assert cached > first.usage.prompt_tokens // 2
    assert second.choices[0].message.content


def test_json_schema_reply_parses_and_validates(client):
    schema = {"type": "object", "properties": {"licence": {"type": "string", "maxLength": 24}},
              "required": ["licence"], "additionalProperties": False}
    completion = client.chat.completions.create(
        model="root", messages=conversation("Answer in JSON.", "Which licence is this?"), max_tokens=48,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "licence", "schema": schema}})
    assert completion.choices[0].finish_reason == "stop"
    value = json.loads(completion.choices[0].message.content)
    jsonschema.validate(value, schema)


def test_a_missing_or_wrong_key_is_401(server):
    wrong = OpenAI(base_url=f"{server.base_url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model="root", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert info.value.code == "invalid_api_key"
    bare = httpx.get(f"{server.base_url}/v1/models")
    assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_a_prompt_longer_than_the_context_is_400(client):
    longer = data_text("gpl-3.txt") * 2  # ~15k tokens; the members take 8,192
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="root", messages=[{"role": "user", "content": longer}], max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    assert "8192" in info.value.message


def test_an_oversized_body_is_413(client):
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="root", messages=[{"role": "user", "content": "x" * 300_000}],
                                       max_tokens=1)
    assert info.value.status_code == 413 and info.value.code == "payload_too_large"


def test_a_request_beyond_the_queue_is_429(client, server):
    messages = conversation("Answer questions about this licence.", "Summarise it.")
    stream = client.chat.completions.create(model="root", messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    first = next(iter(stream))  # the only slot is now taken
    assert first.choices[0].delta.role == "assistant"
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="root", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert info.value.code == "queue_full"
    assert int(info.value.response.headers["retry-after"]) >= 1  # when to come back, in seconds
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason in ("stop", "length")
    assert server.metric("orchestra_rejected_requests_total") >= 1


def test_a_client_leaving_mid_stream_stops_generation_within_a_step(client, server):
    server.wait_idle()
    before = server.metric("orchestra_tokens_total", direction="out")
    stream = client.chat.completions.create(
        model="root", messages=conversation("Tell a long story about this licence.", "Begin."), max_tokens=64,
        temperature=0, stream=True)
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    stream.close()  # the client goes away
    server.wait_idle()
    generated = server.metric("orchestra_tokens_total", direction="out") - before
    # the tokens it read, plus the one or two in flight when it left: nowhere near the 64 asked for
    assert 3 <= generated <= 6, generated
    # and the server is free for the next request at once
    assert client.chat.completions.create(model="root", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1).choices


def test_the_openai_client_example_runs_against_the_server(server, tmp_path):
    document = tmp_path / "document.txt"
    document.write_text(f"(example copy)\n{DOCUMENT}", encoding="utf-8")
    done = subprocess.run([sys.executable, str(ROOT / "examples/openai_client.py"), "--base-url",
                           f"{server.base_url}/v1", "--document", str(document), "--max-tokens", "6"],
                          env={**os.environ, "OPENAI_API_KEY": KEY}, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "root: " in done.stdout and "finetuned: " in done.stdout
    assert "cache: mapped (source root" in done.stdout, done.stdout


LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Find the passages of the licence that mention a word.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}


def test_tools_give_a_valid_call_then_a_reply_over_the_cached_document(client):
    messages = conversation("Answer questions about this licence.", "Which passages mention warranty?")
    first = client.chat.completions.create(model="root", messages=messages, tools=[LOOKUP], tool_choice="required",
                                           max_tokens=64, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "lookup" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), LOOKUP["function"]["parameters"])  # the grammar
    history = [*messages, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "15. Disclaimer of Warranty."}]
    second = client.chat.completions.create(model="finetuned", messages=history, tools=[LOOKUP], max_tokens=32,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("tool_calls", "stop", "length")
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the document was not prefilled again
    none = client.chat.completions.create(model="root", messages=messages, tools=[LOOKUP], tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_a_streamed_tool_call_arrives_as_a_tool_calls_delta(client):
    messages = conversation("Answer questions about this licence.", "Find the word conveying.")
    chunks = list(client.chat.completions.create(
        model="root", messages=messages, tools=[LOOKUP], tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=64, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].tool_calls[0].function.name == "lookup"
    json.loads(deltas[0].tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_bad_tool_requests_are_400_naming_the_field(client):
    messages = conversation("Answer questions about this licence.", "Hi")
    with pytest.raises(openai.BadRequestError, match="not among tools"):
        client.chat.completions.create(model="root", messages=messages, tools=[LOOKUP], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "other"}})
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model="root", max_tokens=4, tools=[LOOKUP], messages=[
            *messages, {"role": "tool", "tool_call_id": "call_unknown", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="response_format and tools"):
        client.chat.completions.create(model="root", messages=messages, tools=[LOOKUP], max_tokens=4,
                                       response_format={"type": "json_object"})


def test_a_langgraph_tool_loop_runs_to_a_final_answer_against_the_server(server):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    looked_up: list[str] = []

    @tool
    def lookup(word: str) -> str:
        """Find the passages of the licence that mention a word."""
        looked_up.append(word)
        return "\n".join(line for line in DOCUMENT.splitlines() if word.lower() in line.lower())[:400] or "none"

    chat = ChatOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, model="root", max_tokens=48, temperature=0,
                      max_retries=0, timeout=HANG_GUARD_S)

    def agent(state: MessagesState) -> dict:
        called = any(isinstance(m, ToolMessage) for m in state["messages"])
        llm = chat.bind_tools([lookup], tool_choice="none" if called else "required")  # one lookup, then answer
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([lookup]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    result = graph.compile().invoke({"messages": [
        SystemMessage(f"Answer questions about this licence.\n\n{DOCUMENT}"),
        HumanMessage("Which passages mention warranty? Look them up.")]}, {"recursion_limit": 8})
    messages = result["messages"]
    calls = [m for m in messages if isinstance(m, AIMessage) and m.tool_calls]
    assert len(calls) == 1 and calls[0].tool_calls[0]["name"] == "lookup" and looked_up
    assert any(isinstance(m, ToolMessage) for m in messages)
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls and final.content.strip()
    assert final.response_metadata["token_usage"]["prompt_tokens_details"]["cached_tokens"] > 0
