"""The connector's settings: what vLLM's ``kv_connector_extra_config`` holds for orchestra's family cache."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from orchestra.familycache.gates import GatePolicy

__all__ = ["ConnectorSettings"]


class ConnectorSettings(BaseModel):
    """Which family member this vLLM engine serves, and the store it shares with the family's other engines."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    home: str
    """The family home (``orchestra family init`` / ``orchestra family build``): its manifest and mappings."""
    member: str
    """The member this engine serves, by name or role; vLLM's model must be that member's folder."""
    store: str | None = None
    """The KV store folder every engine of the family shares (default: ``<home>/kv``)."""
    store_mb: int = Field(8192, ge=1)
    """The store's byte budget in MiB: least recently used entries go first."""
    min_tokens: int = Field(64, ge=1)
    """Shorter prompts are neither saved nor loaded (recomputing them is cheaper)."""
    min_mapped_tokens: int = Field(64, ge=1)
    """A mapped load must bring at least this many tokens beyond what the engine holds."""
    tail_tokens: int = Field(32, ge=2)
    """Positions at the end of a mapped prefix recomputed on the member (what the probe gate reads)."""
    mapping_dir: str | None = None
    """Where the family's mappings are (default: ``<home>/mappings``)."""
    warm: bool = True
    """Load the models a map needs when the engine starts (else on the first mapped request)."""
    adapters: dict[str, str] = Field(default_factory=dict)
    """The engine's LoRA adapters, ``name -> adapter folder`` (the pairs given to vLLM's ``--lora-modules``): each
    is a member of its own over the engine's member, with its own exact entries and maps from its base and
    from its sibling adapters. A request on a LoRA the connector was not told of is neither loaded nor saved."""
    calibrate: bool = False
    """Calibrate a missing map (base -> adapter, adapter -> adapter, root -> member) the first time a request
    needs it, in the background (that request waits for it); else such a request computes its prefix."""
    calibrate_tokens: int = Field(4096, ge=256)
    """Tokens of calibration text per map calibrated on demand."""
    gate: GatePolicy | None = None
    """The gates a mapped load must pass (default: orchestra's, `GatePolicy()`): a pipeline's ``gate:``."""
    events: str | None = None
    """A JSON-lines file the connector appends one line to per load, save and refusal (tests, dashboards)."""

    @property
    def store_dir(self) -> Path:
        return Path(self.store) if self.store else Path(self.home) / "kv"

    @property
    def handoff_dir(self) -> Path:
        """Mapped caches on their way to a worker: beside the store, never inside it (the store reads every
        file in its folders as one of its entries, and removes what is not)."""
        return self.store_dir.with_name(self.store_dir.name + "-handoff")
