"""What a FamilyCache did for one request, step by step, with what each step cost."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = ["CacheStep", "StepKind"]

StepKind = Literal["hit", "join", "prefill", "map", "repair", "gate", "shadow", "fallback", "evict", "load"]


class CacheStep(BaseModel):
    """One step taken to serve a request (a typed event; the pipeline re-emits it with its run id)."""

    step: StepKind
    """hit: served from a cached prefix with no compute; join: waited for a build in flight (of the same
    tokens, or of a longer prefix to extend or map);
    prefill: tokens computed exactly on the member; map: another member's cache carried across;
    repair: part of a mapped cache recomputed; gate: a gate's decision; shadow: a sampled re-prefill;
    fallback: a mapped cache refused, re-prefilled instead; evict: an entry dropped for the budget."""
    member: str
    """The family member (alias) the step ran for."""
    tokens: int = 0
    """Tokens the step covers (computed, mapped, or held by the evicted entry)."""
    reused_tokens: int = 0
    """Tokens taken from a cached prefix instead of being computed."""
    seconds: float = 0.0
    """Wall seconds the step took."""
    source: str | None = None
    """For map steps: the member whose cache was mapped."""
    passed: bool | None = None
    """For gate and shadow steps: the decision."""
    reason: str | None = None
    """Why: the gate's reason, the fallback's cause."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Measurements behind a decision (probe NLL, KL, ...)."""
    detail: dict[str, Any] = Field(default_factory=dict)
    """Anything else worth logging: the repair plan, the mapping's folder, bytes evicted."""
