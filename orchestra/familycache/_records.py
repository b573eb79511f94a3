"""What a mapped entry knows about how it was made: typed, frozen, read by attribute.

A mapped cache carries its story (which member's cache, through which mapping, its probe reading and
repair) so gates, leases and fallback reasons read fields instead of keys; the story becomes dicts
only where a lease hands it to events, reports and headers.
"""

from __future__ import annotations

from dataclasses import dataclass

from mappings.repair_records import RepairSummary
from orchestra.familycache.gates import GateDecision, ProbeGate, decide_probe

__all__ = ["MappedFrom", "ProbeReading"]


@dataclass(frozen=True)
class ProbeReading:
    """The probe measured on a mapped cache's recomputed tail, beside the pair's calibrated references."""

    probe_nll: float
    reference_nll: float
    """The source's NLL on the probe tokens plus the pair's calibrated target-minus-source offset."""
    probe_source_kl: float
    reference_source_kl: float | None
    calibrated_mapped_excess: float | None = None
    probe_source_top1: float | None = None
    """Share of probe positions whose most likely token is the source's."""
    probe_entropy_shift: float | None = None
    """Mean next-token entropy on the probe, target minus source (nats): a map that blurs the target raises it."""

    def decide(self, gate: ProbeGate) -> GateDecision:
        readings = {k: v for k, v in (("probe_source_top1", self.probe_source_top1),
                                      ("probe_entropy_shift", self.probe_entropy_shift)) if v is not None}
        return decide_probe(gate, self.probe_nll, self.reference_nll, self.probe_source_kl, self.reference_source_kl,
                            readings)


@dataclass(frozen=True)
class MappedFrom:
    """How a mapped entry was made: the source member's exact cache carried through a mapping, then repaired."""

    source: str
    """The member whose exact cache was mapped."""
    source_fingerprint: str
    mapping_id: str
    """Content hash of the mapping's tensors (the entry's namespace names it too)."""
    mapping_path: str | None
    """Folder of the mapping used (None for a mapping without one)."""
    mapped_tokens: int
    """Leading positions carried across (the rest were computed exactly on the member)."""
    tail: int
    """Trailing positions of the mapped prefix recomputed on the member (they feed the probe)."""
    exact_sinks: int
    """Leading positions made the member's own by a forward of those tokens alone."""
    probe: ProbeReading | None
    repair: RepairSummary | None
    seconds: float = 0.0

    @property
    def carried_tokens(self) -> int:
        """Positions neither recomputed nor computed: what a fresh map saved the member."""
        return self.mapped_tokens - self.tail - self.exact_sinks
