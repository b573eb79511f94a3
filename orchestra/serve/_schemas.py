"""The OpenAI chat-completions wire format, as pydantic models (they also give the OpenAPI schema).

Requests are validated strictly, as OpenAI does: a string where a number or a boolean belongs (`"max_tokens": "8"`,
`"stream": 0`) is a 400, not coerced. A request's every field is honoured, or accepted because it cannot change
the reply (`user`, `metadata`, ...); any other field is a 400 naming it, never silently dropped (docs/serving.md
lists them). Inside messages, tools and formats, unknown keys are ignored (clients send back reply objects whole).
"""

from __future__ import annotations

import builtins
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = [
    "TextPart",
    "ChatMessage",
    "JsonSchemaSpec",
    "ResponseFormat",
    "StreamOptions",
    "ChatCompletionRequest",
    "allowed_range",
    "TopLogprob",
    "TokenLogprob",
    "ChoiceLogprobs",
    "PromptTokensDetails",
    "Usage",
    "AssistantMessage",
    "Choice",
    "ChatCompletion",
    "Delta",
    "ChunkChoice",
    "ChatCompletionChunk",
    "ModelCard",
    "ModelList",
    "PrefillRequest",
    "PrefillResponse",
    "ErrorDetail",
    "ErrorBody",
]

INT64 = 2**63
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_TOP_LOGPROBS = 20
TokenId = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,12}$")]
"""A token id, as a JSON object key (`logit_bias`)."""
Bias = Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]


class TextPart(BaseModel):
    """A text part of a message's content (the only part type a text model reads)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """The function a tool call names, and its arguments as a JSON text (as the OpenAI API sends them)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1)
    arguments: str = "{}"


class ToolCall(BaseModel):
    """A call the assistant made (in a reply, or sent back in the conversation's history)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of the conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant: the calls it made.")
    tool_call_id: str | None = Field(None, description="tool: the id of the call this message answers.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _object_schema() -> dict[str, object]:
    return {"type": "object"}


class JsonSchemaSpec(BaseModel):
    """`response_format.json_schema`: the schema the reply must follow."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, object] = Field(default_factory=_object_schema, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """text (default), json_object (any JSON object) or json_schema (an object following a schema)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.type is json_schema: give response_format.json_schema")
        return self


def _no_parameters() -> dict[str, object]:
    return {"type": "object", "properties": {}}


class ToolFunction(BaseModel):
    """A function the model may call: its name, what it does, and the JSON schema of its arguments."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, object] = Field(default_factory=_no_parameters)
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: the reply must call this function."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions. Every field is honoured or harmless; any other is refused (400 naming it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = Field(min_length=1, description="A family member by role (root, finetuned, ...) or by name.")
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI in favour of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Default 1; 0 is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=INT64, description="Sample from the k likeliest tokens (vLLM); -1 or "
                              "0: off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Drop tokens less likely than min_p times the "
                                "likeliest (vLLM); 0: off.")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Subtracted from a token's logit per "
                                            "time the reply has it.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Subtracted from a token's logit if "
                                           "the reply has it.")
    repetition_penalty: float | None = Field(None, gt=0.0, description="vLLM's: logits of tokens in the prompt or "
                                             "the reply divided by it (multiplied when negative); 1: off.")
    logit_bias: dict[TokenId, Bias] | None = Field(None, description="Token id -> bias (-100 to 100) added to its "
                                                   "logit.")
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="Only one choice per request.")
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = Field(None, description="Functions the model may call (one call per reply).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="Accepted; a reply makes at most one call.")
    logprobs: bool | None = Field(None, description="Return each reply token's log-probability (of the model's raw "
                                  "output, before penalties and temperature).")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs: the likeliest "
                                     "tokens of each step too.")
    # accepted, without effect on the reply
    user: str | None = Field(None, description="Accepted; not used.")
    metadata: dict[str, str] | None = Field(None, description="Accepted; not stored.")
    store: bool | None = Field(None, description="Accepted; nothing is stored.")
    service_tier: str | None = Field(None, description="Accepted; there is one tier.")
    prompt_cache_key: str | None = Field(None, description="Accepted; the prefix cache needs no key.")
    safety_identifier: str | None = Field(None, description="Accepted; not used.")
    modalities: list[Literal["text"]] | None = Field(None, description="Text only.")

    @field_validator("logprobs")
    @classmethod
    def _logprobs_of_text(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        tools, choice = info.data.get("tools"), info.data.get("tool_choice")
        if value and tools and choice != "none":
            raise ValueError("logprobs cannot be combined with tools: a tool reply is rewritten into a call")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @model_validator(mode="after")
    def _tools_consistent(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among tools "
                             f"({', '.join(names) or 'none'})")
        if self.tool_choice in ("required",) and not names:
            raise ValueError("tool_choice is required but no tools are given")
        if self.tool_mode() and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format and tools cannot be used together: a reply is a call or an answer")
        called: set[str] = set()
        for i, message in enumerate(self.messages):
            for call in message.tool_calls or []:
                called.add(call.id)
            if message.role == "tool":
                if not message.tool_call_id:
                    raise ValueError(f"messages[{i}].tool_call_id: a tool message answers a call: give its id")
                if message.tool_call_id not in called:
                    raise ValueError(f"messages[{i}].tool_call_id: {message.tool_call_id!r} is not the id of a call "
                                     "an earlier assistant message made")
        return self

    def tool_mode(self) -> bool:
        """Tools are offered for this reply (given, and tool_choice is not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else list(value or [])
        if len(items) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in items):
            raise ValueError("stop sequences must not be empty")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def allowed_range(param: str) -> str | None:
    """The range a numeric request field takes, as a 400 states it: ``"-2 to 2"`` (None for other fields)."""
    top = param.split(".", 1)[0]
    if top == "logit_bias":
        return f"{LOGIT_BIAS_RANGE[0]:g} to {LOGIT_BIAS_RANGE[1]:g}"
    found = ChatCompletionRequest.model_fields.get(top)
    if found is None:
        return None
    low = high = None
    for item in found.metadata:  # pydantic's constraint markers (annotated_types' Ge, Gt, Le, Lt)
        if getattr(item, "ge", None) is not None:
            low = _number(item.ge)
        elif getattr(item, "gt", None) is not None:
            low = f"more than {_number(item.gt)}"
        elif getattr(item, "le", None) is not None:
            high = _number(item.le)
        elif getattr(item, "lt", None) is not None:
            high = f"under {_number(item.lt)}"
    if low is None and high is None:
        return None
    if high is None:
        return low if low and low.startswith("more") else f"{low} or more"
    if low is None:
        return high if high.startswith("under") else f"{high} or less"
    return f"{low} to {high}"


def _number(value: object) -> str:
    if isinstance(value, int) and abs(value) == INT64:
        return "-2^63" if value < 0 else "2^63"
    return f"{value:g}" if isinstance(value, float) else str(value)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens served from the family-wide cache, not recomputed.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="The token's text as UTF-8 bytes (a partial character as U+FFFD).")


class TokenLogprob(BaseModel):
    """A reply token's log-probability under the model's raw output, and the likeliest tokens at its step."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallDelta(BaseModel):
    index: int = 0
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """A family member as an OpenAI model, with what orchestra knows of it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "orchestra"
    name: str = Field(description="The member's name in the family.")
    role: str = Field(description="root, finetuned, quantized, distilled, ...")
    parent: str | None = Field(None, description="The member it was derived from.")
    divergence: dict[str, builtins.object] | None = Field(None, description="Measured KL / top-1 agreement to its parent.")
    max_context: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PrefillRequest(BaseModel):
    """POST /v1/cache/prefill: warm the cache with the start of future conversations."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)


class PrefillResponse(BaseModel):
    model: str
    tokens: int
    path: str
    cached_tokens: int
    seconds: float


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
