"""Typed records of what a repair did: one ladder rung, a whole climb, a repair's summary.

`mappings.repair` builds them and the FamilyCache reads them by attribute; they turn into dicts
(`model_dump()`) only where they become events, report fields or JSON, and the dicts keep the keys
reports and headers have always had (a skipped rung, or a summary without a ladder, leaves its
absent keys out instead of writing nulls).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

__all__ = ["LadderStep", "RepairLadder", "RepairSummary"]


class LadderStep(BaseModel):
    """One rung of an adaptive repair: its budget, the positions it fed the target, and the probe's verdict."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    budget: float
    tokens: int
    """Positions recomputed by this rung (its new positions plus the probe tokens; 0 when skipped)."""
    skipped: bool | None = None
    """True when the rung added no position over the rungs below it (never probed)."""
    passed: bool | None = None
    """The probe's decision (None for a skipped rung)."""
    metrics: dict[str, float] | None = None
    """The probe's measurements (None for a skipped rung)."""

    @model_serializer(mode="wrap")
    def _without_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a skipped rung has always been {"budget", "tokens", "skipped"}, a probed one has no "skipped"
        return {k: v for k, v in handler(self).items() if v is not None}


class RepairLadder(BaseModel):
    """An adaptive repair's climb (`mappings.repair.climb_repair`): the budgets tried and what they cost."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    budgets: list[float]
    passed: float | None
    """The budget whose cache passed the probe (None: none did)."""
    spent: float
    """Compute of the rungs beyond the first probe, as a share of a prefill."""
    token_share: float
    recomputed: int
    """Positions fed to the target in all rungs."""
    repaired: int
    """Distinct positions repaired outside the probe tokens."""
    probe_tokens: int
    stopped: str | None
    """Why the climb ended without a pass (None: it passed)."""
    steps: list[LadderStep] = Field(default_factory=list)

    def refusal_note(self) -> str:
        """What the climb tried, for a fallback reason ('' when it passed: another gate refused the cache)."""
        if self.passed is not None:
            return ""
        tried = [f"{s.budget:.0%}" for s in self.steps if not s.skipped]
        why = f" ({self.stopped})" if self.stopped else ""
        return (f"; repair ladder tried {', '.join(tried)} without a pass{why}, spending {self.spent:.1%} of a "
                f"prefill ({self.recomputed} positions recomputed)")


class RepairSummary(BaseModel):
    """What a repair recomputed on one mapped cache, its planned cost and seconds (the `repair` event field)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: dict[str, Any]
    """The policy applied, as JSON (`RepairPolicy.model_dump(mode="json")`)."""
    tokens: int
    tail: int
    scattered: int
    blocks: list[list[int]]
    cost: float
    costs: str
    exact: int
    token_share: float
    seconds: dict[str, float] = Field(default_factory=dict)
    """Wall seconds by part: ``rank`` (source), ``layers`` and ``tokens`` (target)."""
    ladder: RepairLadder | None = None

    @model_serializer(mode="wrap")
    def _without_ladder(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("ladder") is None:  # a fixed repair's summary has never had a "ladder" key
            out.pop("ladder", None)
        return out

    def with_rank_seconds(self, seconds: float) -> RepairSummary:
        """This summary with the source's ranking time added (it runs where the source lives, before the map)."""
        return self.model_copy(update={"seconds": {**self.seconds, "rank": seconds}})

    @property
    def total_seconds(self) -> float:
        return float(sum(self.seconds.values()))
