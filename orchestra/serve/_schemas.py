"""The OpenAI chat-completions wire format, as pydantic models (they also give the OpenAPI schema).

Requests are validated strictly, as OpenAI does: a string where a number or a boolean belongs (`"max_tokens": "8"`,
`"stream": 0`) is a 400, not coerced; unknown fields are ignored.
"""

from __future__ import annotations

import builtins
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "TextPart",
    "ChatMessage",
    "JsonSchemaSpec",
    "ResponseFormat",
    "StreamOptions",
    "ChatCompletionRequest",
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


class TextPart(BaseModel):
    """A text part of a message's content (the only part type a text model reads)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of the conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions. Unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(min_length=1, description="A family member by role (root, finetuned, ...) or by name.")
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI in favour of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="Only one choice per request.")
    response_format: ResponseFormat | None = None
    user: str | None = None

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


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


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
