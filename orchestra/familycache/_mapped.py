"""The mapped path: a source member's cache of a prefix carried into another member, with what its gate reads.

`MappedPath.map` is the one place a cache is mapped. Given the source's cache of exactly the prefix's tokens,
it takes the source's logits over the prefix's tail (the probe's reference), makes exact the leading sinks
the map needs, prices and plans the repair (an adaptive one climbs against the probe gate), maps onto the
target through the executor (`MapRequest`), and reads the probe on the target's recomputed tail. It decides
nothing: FamilyCache's gates read the `MappedPrefix` it answers and keep or refuse it. FamilyCache calls it
when a route says map; a serving engine's KV connector can call it with the same objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestra.familycache._records import ProbeReading
from orchestra.familycache._requests import (
    ImportanceRequest,
    MapRequest,
    PassCostsRequest,
    ProbeReferenceRequest,
    TailLogitsRequest,
)
from orchestra.familycache.gates import ProbeCheck

if TYPE_CHECKING:
    from mappings.passcost import PassCosts
    from mappings.repair import RepairPolicy
    from mappings.repair_records import RepairSummary
    from mappings.types import Tensor
    from orchestra.familycache._executor import Executor
    from orchestra.familycache._handles import CacheRef, HiddenRef, MappingRef
    from orchestra.familycache._ops import Computed
    from orchestra.familycache._policy import CachePolicy
    from orchestra.familycache.gates import ProbeGate
    from orchestra.familycache.mapping_store import MappingStore

__all__ = ["MapJob", "MappedPrefix", "MappedPath", "fitted_sinks"]


@dataclass(frozen=True)
class MapJob:
    """What to map: `source`'s cache of exactly `prefix` into `member`, recomputing its last `tail` positions."""

    member: str
    source: str
    prefix: tuple[int, ...]
    source_cache: CacheRef
    tail: int
    repair: RepairPolicy | None = None
    probe_gate: ProbeGate | None = None
    """The probe gate an adaptive repair (a ladder) climbs against; None: the ladder's first budget."""
    source_logits: Tensor | None = None
    """The source's logits over the prefix's last `tail` positions, when the source entry kept them."""
    source_hidden: HiddenRef | None = None
    """The source's hidden states, for a layer repair (dropped, with a warning, when the map has no residuals)."""


@dataclass(frozen=True)
class MappedPrefix:
    """The target's cache of the prefix, with what the gates and the report read of how it was made."""

    computed: Computed
    """The mapped (and repaired) cache, the logits of its last `tail` positions, the seconds it took."""
    repair: RepairSummary | None
    probe: ProbeReading
    sinks: int
    """Leading positions made exact on the target before the map was read."""
    tail: int
    warnings: tuple[str, ...] = field(default=())
    """What the path changed of what was asked (a layer repair it could not do)."""


def fitted_sinks(mapping: MappingRef) -> int:
    """The leading positions a mapping was fitted to have exact (its method's ``exact_sinks``; 0 if unknown)."""
    method = getattr(getattr(mapping, "manifest", None), "method", None)
    return int(getattr(method, "exact_sinks", 0) or 0)


class MappedPath:
    """Maps prefixes through an executor, with the sink, repair and probe settings of a cache policy."""

    def __init__(self, executor: Executor, mappings: MappingStore, policy: CachePolicy,
                 costs_dir: str | None = None) -> None:
        self.executor = executor
        self.mappings = mappings
        self.policy = policy
        self.costs_dir = costs_dir
        """Where the targets' measured pass costs are kept (the repair budget's prices); None: not kept."""

    def map(self, job: MapJob, mapping: MappingRef) -> MappedPrefix:
        """`job`'s prefix mapped onto its member by `mapping`; any failure propagates (a gate failure upstream)."""
        length, tail = len(job.prefix), job.tail
        source_logits = job.source_logits
        if source_logits is None:
            source_logits = self.executor.tail_logits(
                TailLogitsRequest(job.source, job.source_cache, job.prefix, length, tail)).logits
        repair, warnings = self._usable_repair(job, mapping)
        # at least the sinks the map was fitted without (it is only good with them), never into the tail
        sinks = min(max(self.policy.sink_tokens, fitted_sinks(mapping)), max(0, length - tail))
        reference = self.executor.probe_reference(
            ProbeReferenceRequest(job.source, job.member, self.mappings, mapping, tail))
        check = _probe_check(job.prefix[-tail:], source_logits, reference.offset_nll, reference.source_kl)
        if repair is not None and repair.adaptive:
            if job.probe_gate is None:  # nothing to climb against: the ladder's first budget, as a fixed policy
                repair = repair.at(repair.budget)
            else:  # the probe it climbs against; an offline refusal never gets here (decided before the map)
                check = ProbeCheck(check.tail_ids, check.source_logits, check.reference_nll,
                                   check.reference_source_kl, job.probe_gate)
        computed, summary = self._map(job, mapping, repair, check, sinks)
        measured = check.metrics(computed.logits)
        probe = ProbeReading(measured["probe_nll"], measured["reference_nll"], measured["probe_source_kl"],
                             reference.source_kl, reference.mapped_excess_nll, measured["probe_source_top1"],
                             measured["probe_entropy_shift"])
        return MappedPrefix(computed, summary, probe, sinks, tail, warnings)

    def _map(self, job: MapJob, mapping: MappingRef, repair: RepairPolicy | None, check: ProbeCheck,
             sinks: int) -> tuple[Computed, RepairSummary | None]:
        costs = self._costs(job.member, repair)
        if repair is not None and repair.adaptive:
            importance, rank_s = None, 0.0
            if repair.scattered_share > 0 and repair.max_budget > 0:  # ranked where the source lives
                ranked = self.executor.importance(ImportanceRequest(job.source, job.source_cache, job.prefix,
                                                                    repair.probe_tokens, repair.focus_ids))
                importance, rank_s = ranked.scores, ranked.seconds
            result = self.executor.map_cache(MapRequest(job.member, mapping, job.source_cache, job.prefix, job.tail,
                                                        repair, job.source_hidden, importance=importance, probe=check,
                                                        sinks=sinks, costs=costs))
            summary = result.repair
            if summary is not None and importance is not None:
                summary = summary.with_rank_seconds(rank_s)
            return result.computed, summary
        # a fixed scattered-token repair ranks positions by the source model's attention
        reads_source = repair is not None and repair.budget > 0 and repair.scattered_share > 0
        result = self.executor.map_cache(MapRequest(job.member, mapping, job.source_cache, job.prefix, job.tail,
                                                    repair, job.source_hidden,
                                                    source=job.source if reads_source else None, sinks=sinks,
                                                    costs=costs))
        return result.computed, result.repair

    def _costs(self, member: str, repair: RepairPolicy | None) -> PassCosts | None:
        """The member's measured pass costs when a repair is priced in seconds; None otherwise."""
        if repair is None or not (repair.adaptive or repair.budget > 0) or self.policy.repair_costs != "measured":
            return None
        return self.executor.pass_costs(PassCostsRequest(member, self.costs_dir))

    @staticmethod
    def _usable_repair(job: MapJob, mapping: MappingRef) -> tuple[RepairPolicy | None, tuple[str, ...]]:
        """The job's repair, less a layer repair the map or the source cannot support (and why)."""
        repair = job.repair
        if repair is None or repair.budget <= 0 or not (repair.layer_share > 0 or repair.blocks):
            return repair, ()
        if mapping.residual is not None and job.source_hidden is not None:
            return repair, ()
        why = ("the mapping has no residual maps (run `orchestra calibrate-repair`)" if mapping.residual is None
               else "the source cache was built without hidden states")
        return (repair.model_copy(update={"layer_share": 0.0, "blocks": None}),
                (f"{job.member}: layer repair skipped, {why}; repairing tokens only",))


def _probe_check(tail_ids: Sequence[int], source_logits: Tensor, offset_nll: float, source_kl: float) -> ProbeCheck:
    """What the probe gate compares the target's tail with: the source's logits and loss over the same tokens."""
    import torch

    from mappings.metrics import tail_nll

    ids = tuple(tail_ids)
    return ProbeCheck(ids, source_logits, tail_nll(source_logits, torch.tensor(list(ids), dtype=torch.long))
                      + offset_nll, source_kl)
