"""The typed knobs of a FamilyCache: memory, prefix granularity, when mapping pays, probe tail, repair."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mappings.repair import RepairPolicy
from orchestra.familycache.gates import GatePolicy

__all__ = ["CachePolicy"]


class CachePolicy(BaseModel):
    """How a FamilyCache spends memory and compute; per-request arguments override the gate and repair."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget_bytes: int = Field(4 << 30, ge=1)
    """Bytes the cache may hold: K/V, kept tail logits and hidden states kept for repair, all counted."""
    block_tokens: int = Field(16, ge=1)
    """Granularity of the prefix index: prefixes are found block by block, then extended token by token."""
    min_mapped_tokens: int = Field(64, ge=1)
    """Map from another member only when that reuses at least this many more tokens than the best exact prefix."""
    seed_source: bool = True
    """A cold request on a member with a stored mapping from the source builds its tokens on the source and maps
    them (every member asking for that document later maps the same build); False: it prefills on its own."""
    tail_tokens: int = Field(32, ge=2)
    """Trailing tokens recomputed on the target after a map; their logits feed the probe and shadow gates."""
    sink_tokens: int = Field(4, ge=0)
    """First positions of every mapped cache recomputed on the target (a forward of this many tokens): the
    attention sinks, the worst-mapped positions; at least the mapping's own ``exact_sinks`` (the positions it
    was fitted without), so 0 keeps the pure map only for maps fitted on every position."""
    gate: GatePolicy = Field(default_factory=GatePolicy)
    """Gates applied to a mapped cache when the request names none."""
    repair: RepairPolicy | None = None
    """Map, then repair: target compute spent on every fresh map (None or budget 0: pure map; a ladder: adaptive)."""
    repair_costs: Literal["measured", "compute"] = "measured"
    """How a repair budget is priced: "measured" times each target's passes once on this machine (stored beside
    the mappings) so a budget is a share of its prefill seconds; "compute" counts multiply-adds."""
    store: bool = True
    """Keep what is built for later requests (False: every lease owns its cache alone)."""
