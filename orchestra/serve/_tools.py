"""OpenAI tool calls in `orchestra serve`: a request with ``tools`` is decoded under a grammar of a call or an answer.

The conversation's tool turns (assistant ``tool_calls``, ``role: "tool"`` results) are rendered as plain
turns the model reads (a call as the JSON it would write, a result as "Result of <name>: ..."), so every
member's chat template takes them; the earlier messages are rendered as before, so a document in them is
still the cached prefix and a tool round computes only its new tokens. The reply's grammar is
``{"tool": <name>, "arguments": {...}}`` (each offered function; only one with a named ``tool_choice``;
calls only with ``required``) or ``{"answer": "..."}``, so even the 135M model returns a valid call of a
function it was offered; the reply is turned back into ``tool_calls`` (``finish_reason: "tool_calls"``) or
content.
"""

from __future__ import annotations

import json
import uuid

from agents.tools import bound_strings
from orchestra.serve._schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    JsonSchemaSpec,
    NamedToolChoice,
    ResponseFormat,
    ToolCall,
    ToolDefinition,
)

__all__ = ["prepare_tool_request", "read_tool_reply", "has_tool_turns", "ToolReply"]


def has_tool_turns(req: ChatCompletionRequest) -> bool:
    """The conversation holds tool calls or results (they are rendered as plain turns)."""
    return any(m.role == "tool" or m.tool_calls for m in req.messages)

TOOL_REPLY = "tool_reply"
"""The `response_format.json_schema.name` of a tool-mode reply. Its grammar is laid out with a fixed 2-space indent
and no other whitespace (`json_constraint`), as the agents' tool rounds are: JSON's any-whitespace grammar lets a
small model pad the call with whitespace until max_tokens, and no call comes back. The server parses the reply
itself, so the layout is never the client's."""

MAX_ARGUMENT_CHARS = 40
"""Longest string argument the grammar allows, unless the tool's schema sets maxLength (a small model otherwise
writes one until max_tokens, and the call is cut off)."""


class ToolReply:
    """What a tool-mode reply was: a call, or an answer."""

    def __init__(self, content: str | None, calls: list[ToolCall]) -> None:
        self.content = content
        self.calls = calls

    @property
    def finish_reason(self) -> str | None:
        return "tool_calls" if self.calls else None


def prepare_tool_request(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """The request as the model sees it: tool turns as plain turns and, when tools are offered for this reply,
    the tools described and the reply's grammar set."""
    offered = _offered(req)
    names = {call.id: call.function.name for m in req.messages for call in m.tool_calls or []}
    messages: list[ChatMessage] = []
    for message in req.messages:
        if message.role == "tool":
            name = names.get(message.tool_call_id or "", "the tool")
            messages.append(ChatMessage(role="user", content=f"Result of {name}: {message.text()}"))
        elif message.role == "assistant" and message.tool_calls:
            calls = [json.dumps({"tool": c.function.name, "arguments": _arguments(c.function.arguments)})
                     for c in message.tool_calls]
            messages.append(ChatMessage(role="assistant", content="\n".join([message.text(), *calls]).strip()))
        else:
            messages.append(message)
    if not req.tool_mode():  # tool_choice none (or no tools): an ordinary reply to a history with tool turns
        return req.model_copy(update={"messages": messages})
    last = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
    described = _describe(offered, must_call=_must_call(req))
    if last is None:
        messages.append(ChatMessage(role="user", content=described))
    else:
        messages[last] = ChatMessage(role="user", content=f"{messages[last].text()}\n\n{described}")
    schema = _reply_schema(offered, must_call=_must_call(req))
    fmt = ResponseFormat(type="json_schema", json_schema=JsonSchemaSpec.model_validate({"name": TOOL_REPLY,
                                                                                         "schema": schema}))
    return req.model_copy(update={"messages": messages, "response_format": fmt})


def read_tool_reply(text: str) -> ToolReply:
    """The reply decoded under the tool grammar: its call (with a fresh id) or its answer."""
    from agents.structured import extract_json_object
    from agents.tools import answer_text

    reply = extract_json_object(text)
    name = reply.get("tool") if isinstance(reply, dict) else None
    if isinstance(reply, dict) and isinstance(name, str):
        arguments = reply.get("arguments")
        call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(
            name=name, arguments=json.dumps(arguments if isinstance(arguments, dict) else {})))
        return ToolReply(None, [call])
    return ToolReply(answer_text(text), [])


def _offered(req: ChatCompletionRequest) -> list[ToolDefinition]:
    tools = list(req.tools or [])
    if isinstance(req.tool_choice, NamedToolChoice):
        return [t for t in tools if t.function.name == req.tool_choice.function.name]
    return tools


def _must_call(req: ChatCompletionRequest) -> bool:
    return req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)


def _reply_schema(tools: list[ToolDefinition], *, must_call: bool) -> dict[str, object]:
    calls = [{"type": "object", "properties": {"tool": {"const": t.function.name},
                                               "arguments": bound_strings(t.function.parameters,
                                                                                         MAX_ARGUMENT_CHARS)},
              "required": ["tool", "arguments"], "additionalProperties": False} for t in tools]
    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    return {"anyOf": calls if must_call else [*calls, answer]}


def _describe(tools: list[ToolDefinition], *, must_call: bool) -> str:
    lines = ["You can call these functions:"]
    for t in tools:
        props = t.function.parameters.get("properties")
        args = ", ".join(props) if isinstance(props, dict) else ""
        lines.append(f"- {t.function.name}({args}): {t.function.description or ''}".rstrip(": "))
    lines.append('To call one, reply {"tool": "<name>", "arguments": {...}}.'
                 + ("" if must_call else ' To answer instead, reply {"answer": "..."}.'))
    return "\n".join(lines)


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text
