"""What a FamilyCache did for one request, step by step, with what each step cost."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mappings.repair_records import RepairSummary

__all__ = ["CacheStep", "StepKind", "StepDetail", "HitDetail", "JoinDetail", "PrefillDetail", "MapDetail",
           "LoadDetail", "EvictDetail", "RepairSummary"]

StepKind = Literal["hit", "join", "prefill", "map", "repair", "gate", "shadow", "fallback", "evict", "load"]


EntryKind = Literal["exact", "mapped"]


class StepDetail(BaseModel):
    """What a step of one kind records beyond the fields every step has."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, serialize_by_alias=True)


class HitDetail(StepDetail):
    """hit: the entry served, as long as it is (a prefix of it may be what the request holds)."""

    entry_tokens: int
    kind: EntryKind


class JoinDetail(StepDetail):
    """join: the build waited for (a shadow's reference records none of this)."""

    waited_for: EntryKind
    prefix_of: int
    """Tokens of the build waited for."""
    on: str
    """The member it was built on."""


class PrefillDetail(StepDetail):
    """prefill: what the exact tokens were computed over (None: the member's own cache or nothing)."""

    over: Literal["mapped"] | None = None


class MapDetail(StepDetail):
    """map: the mapping applied, the tail recomputed on the target, the sinks made exact before the map was read."""

    mapping: str
    tail: int
    exact_sinks: int


class LoadDetail(StepDetail):
    """load: a cache read from the disk tier (a corrupt or vanished one records only where it was looked for)."""

    from_: Literal["disk"] = Field("disk", alias="from")
    kind: EntryKind | None = None
    entry_tokens: int | None = None
    bytes: int | None = None
    key: str | None = None


class EvictDetail(StepDetail):
    """evict: what the dropped entry held."""

    bytes: int
    kind: EntryKind


Detail = HitDetail | JoinDetail | PrefillDetail | MapDetail | LoadDetail | EvictDetail | RepairSummary
_DETAILS: dict[str, type[BaseModel]] = {"hit": HitDetail, "join": JoinDetail, "prefill": PrefillDetail,
                                        "map": MapDetail, "load": LoadDetail, "evict": EvictDetail,
                                        "repair": RepairSummary}
"""Step kind -> the type of its detail (the other kinds have none)."""


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
    detail: Detail | None = None
    """What this kind of step records besides: the entry hit, the build joined, the mapping applied, the repair
    summary, the entry loaded or evicted (the type is the step kind's: `HitDetail`, ..., `RepairSummary`)."""

    @property
    def entry_kind(self) -> EntryKind | None:
        """The kind of the entry a hit, load or eviction was about (None for other steps, or not recorded)."""
        return getattr(self.detail, "kind", None) if isinstance(self.detail, (HitDetail, LoadDetail, EvictDetail)) \
            else None

    @model_validator(mode="before")
    @classmethod
    def _detail_of_its_kind(cls, data: object) -> object:
        """A detail given as a mapping (read back from JSON) is validated as its step kind's type."""
        if isinstance(data, dict) and isinstance(data.get("detail"), dict):
            kind = _DETAILS.get(str(data.get("step")))
            detail = data["detail"]
            data = {**data, "detail": kind.model_validate(detail) if kind is not None and detail else None}
        return data
