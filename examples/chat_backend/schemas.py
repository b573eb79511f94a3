"""Request and response bodies (pydantic at the HTTP boundary)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DocumentIn",
    "DocumentOut",
    "SessionIn",
    "SessionOut",
    "MessageIn",
    "SwitchIn",
    "ModelOut",
    "CacheInfo",
]

CachePath = Literal["exact", "mapped", "reprefilled"]


class DocumentIn(BaseModel):
    """Either the document's text, or the name of a bundled document (see GET /documents/bundled)."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = Field(None, description="The document itself.")
    bundled: str | None = Field(None, description="Name of a bundled document, e.g. 'gpl-3.txt'.")
    max_chars: int | None = Field(None, ge=1, description="Keep only the first N characters (handy for demos).")
    name: str | None = Field(None, max_length=200, description="A label for listings.")

    @model_validator(mode="after")
    def _one_source(self) -> DocumentIn:
        if (self.text is None) == (self.bundled is None):
            raise ValueError("give exactly one of `text` or `bundled`")
        return self


class CacheInfo(BaseModel):
    """How the FamilyCache served a document's or a turn's cache on one model (from its lease)."""

    model: str
    path: CachePath = Field(description="exact: the member's own K/V; mapped: from `source` through a mapping; "
                                        "reprefilled: a mapped cache was refused (`fallback_reason`) and recomputed.")
    source: str | None = Field(None, description="The member whose cache was mapped (mapped, reprefilled).")
    tokens: int = Field(0, description="Positions the cache holds.")
    reused_tokens: int = Field(0, description="Positions taken from a cached prefix (or carried by the map).")
    computed_tokens: int = Field(0, description="Positions computed on the member for this request.")
    seconds: float
    fallback_reason: str | None = None
    gates: list[dict] = Field(default_factory=list)


class DocumentOut(BaseModel):
    document_id: str
    name: str
    tokens: int
    source_model: str
    prefill_s: float
    reused: bool = Field(description="True when the same document was already prefilled (same id returned).")
    caches: dict[str, CacheInfo] = Field(default_factory=dict)


class SessionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    document_id: str
    model: str = Field(description="Family member role (root, finetuned, quantized, distilled) or name.")
    system: str | None = Field(None, max_length=4000, description="System prompt (default: the server's).")


class SessionOut(BaseModel):
    session_id: str
    document_id: str
    model: str
    messages: list[dict[str, str]]
    cache: CacheInfo | None
    context_tokens: int
    max_context_tokens: int


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str = Field(min_length=1, max_length=20_000)
    model: str | None = Field(None, description="Switch the session to this member before answering.")
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    seed: int | None = None


class SwitchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str


class ModelOut(BaseModel):
    alias: str
    name: str
    layers: int
    source: bool
    loaded: bool
