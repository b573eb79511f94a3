"""Typed events streamed while a pipeline runs (for chat backends, logs and the report)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from orchestra.familycache._events import CacheStep
from orchestra.observability.report import RunReport

__all__ = [
    "Event",
    "RunStarted",
    "DocumentPrefilled",
    "CacheReady",
    "CacheStepEvent",
    "AgentStarted",
    "TokenEvent",
    "GateResult",
    "Fallback",
    "AgentFinished",
    "AgentFailed",
    "AgentSkipped",
    "AgentDegenerate",
    "AgentRestored",
    "ToolCallEvent",
    "ToolResultEvent",
    "RunFinished",
    "AnyEvent",
]

CachePath = Literal["exact", "mapped", "reprefilled"]


class Event(BaseModel):
    """Base of every event: what happened, when (unix seconds), in which run."""

    kind: str
    run_id: str
    at: float = Field(default_factory=time.time)


class RunStarted(Event):
    kind: Literal["run_started"] = "run_started"
    agents: list[str]
    source_model: str
    document_tokens: int


class DocumentPrefilled(Event):
    kind: Literal["document_prefilled"] = "document_prefilled"
    model: str
    tokens: int
    seconds: float
    store_hit: bool
    chunk: int | None = None
    """Chunked runs: the document chunk's index (None: the whole document)."""


class CacheReady(Event):
    kind: Literal["cache_ready"] = "cache_ready"
    model: str
    agent: str | None = None
    """The agent the cache is for (None: the run's own prefill of the document or a chunk on the source)."""
    path: CachePath
    seconds: float
    store_hit: bool
    repair: dict[str, object] | None = None
    """Mapped caches repaired under the pipeline's repair policy: tokens, tail, blocks and cost."""
    chunk: int | None = None
    """Chunked runs: the document chunk's index (None: the whole document)."""


class CacheStepEvent(Event):
    """One step FamilyCache took to give an agent (or the run's source prefill) its cache, with its cost."""

    kind: Literal["cache_step"] = "cache_step"
    agent: str | None = None
    """The agent the cache was for (None: the run's own document prefill on the source)."""
    step: CacheStep
    chunk: int | None = None
    """Chunked runs: the document chunk's index (None: the whole document)."""


class AgentStarted(Event):
    kind: Literal["agent_started"] = "agent_started"
    agent: str
    model: str


class TokenEvent(Event):
    kind: Literal["token"] = "token"
    agent: str
    text: str
    index: int
    chunk: int | None = None
    """The document chunk this token's call reads (chunked runs: an agent's calls may stream at once)."""


class GateResult(Event):
    kind: Literal["gate"] = "gate"
    agent: str
    model: str
    passed: bool
    reason: str
    metrics: dict[str, float] = Field(default_factory=dict)
    chunk: int | None = None
    """Chunked runs: the document chunk's index (None: the whole document)."""


class Fallback(Event):
    kind: Literal["fallback"] = "fallback"
    agent: str
    model: str
    reason: str
    chunk: int | None = None
    """Chunked runs: the document chunk's index (None: the whole document)."""


class AgentFinished(Event):
    kind: Literal["agent_finished"] = "agent_finished"
    agent: str
    output: str
    parsed: object = None


class AgentFailed(Event):
    kind: Literal["agent_failed"] = "agent_failed"
    agent: str
    error_type: str
    error: str


class AgentSkipped(Event):
    kind: Literal["agent_skipped"] = "agent_skipped"
    agent: str
    reason: str


class AgentDegenerate(Event):
    """The agent finished but its output is degenerate; downstream agents that need it are skipped."""

    kind: Literal["agent_degenerate"] = "agent_degenerate"
    agent: str
    reason: str
    """Which check fired and why (agents.degenerate)."""
    output: str


class ToolCallEvent(Event):
    """An agent called one of its tools (`agents.tools`)."""

    kind: Literal["tool_call"] = "tool_call"
    agent: str
    tool: str
    arguments: dict[str, object]
    round: int


class ToolResultEvent(Event):
    """What a tool call returned (or its error, which the agent read), and how long it took."""

    kind: Literal["tool_result"] = "tool_result"
    agent: str
    tool: str
    result: str
    ok: bool
    seconds: float
    round: int


class AgentRestored(Event):
    """A resumed run kept this agent's result from its checkpoint instead of running it again."""

    kind: Literal["agent_restored"] = "agent_restored"
    agent: str
    status: str
    output: str | None = None


class RunFinished(Event):
    kind: Literal["run_finished"] = "run_finished"
    succeeded: list[str]
    failed: list[str]
    skipped: list[str]
    seconds: float
    degenerate: list[str] = Field(default_factory=list)
    report: RunReport | None = None
    """This run's whole report (concurrent runs each get their own; `last_report` is only the latest)."""


AnyEvent = Annotated[
    RunStarted | DocumentPrefilled | CacheReady | CacheStepEvent | AgentStarted | TokenEvent | GateResult | Fallback
    | AgentFinished | AgentFailed | AgentSkipped | AgentDegenerate | AgentRestored | ToolCallEvent | ToolResultEvent
    | RunFinished,
    Field(discriminator="kind"),
]
