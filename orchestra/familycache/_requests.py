"""The executor seam's requests and results: one frozen object per kind of model work, shared by every executor.

FamilyCache says what model work it wants as one of these and hands it to its `Executor` (`compute`,
`tail_logits`, `map_cache`, `load_mapping`, `probe_reference`, `importance`, `pass_costs`), which runs it
where the models live (in process: the ops of `_ops`; Ray: the members' actors) and answers with the
matching result. The fields are the whole contract, so the local and the Ray executor read the same
definition, and a new executor (a vLLM connector's) implements the same methods over the same objects.

Caches, hidden states and mappings in them are handles (`CacheRef`, `HiddenRef`, `MappingRef`): the objects
themselves in process, references to objects stored elsewhere under a remote executor. Token ids are tuples,
so a request is immutable and can be shipped as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

    from mappings.passcost import PassCosts
    from mappings.repair import RepairPolicy
    from mappings.repair_records import RepairSummary
    from mappings.types import Tensor
    from orchestra.familycache._handles import CacheRef, HiddenRef, MappingRef
    from orchestra.familycache._ops import Computed
    from orchestra.familycache.gates import ProbeCheck
    from orchestra.familycache.mapping_store import MappingStore

__all__ = ["ComputeRequest", "TailLogitsRequest", "MapRequest", "MapResult", "MappingRequest", "MappingResult",
           "ProbeReferenceRequest", "ImportanceRequest", "Importance", "PassCostsRequest", "EngineCache"]


@dataclass(frozen=True)
class ComputeRequest:
    """Compute ``ids[start:]`` exactly on `member`, over the first `start` positions of `base` (a prefill when
    `start` is 0); the answer is a `Computed` cache of ``len(ids)`` positions."""

    member: str
    ids: tuple[int, ...]
    base: CacheRef | None = None
    start: int = 0
    keep_logits: int = 0
    """Logits kept for this many trailing positions (the probe gate and a later map read them)."""
    base_hidden: HiddenRef | None = None
    """`base`'s hidden states, joined with the new ones when `want_hidden`."""
    want_hidden: bool = False
    """Keep the hidden state entering each layer (a layer repair of a later map reads the source's)."""


@dataclass(frozen=True)
class TailLogitsRequest:
    """The logits of positions ``[end - tail, end)`` of `ids` on `member`, recomputed over `cache`'s first
    ``end - tail`` positions (a `Computed` whose cache extends a copy, never `cache` itself)."""

    member: str
    cache: CacheRef
    ids: tuple[int, ...]
    end: int
    tail: int


@dataclass(frozen=True)
class MapRequest:
    """`source_cache` (exactly the positions of `ids`) mapped onto `target` by `mapping`, repaired per `repair`,
    its last `tail` positions recomputed on the target (`_ops.map_into` says what each part does)."""

    target: str
    mapping: MappingRef
    source_cache: CacheRef
    ids: tuple[int, ...]
    tail: int
    repair: RepairPolicy | None = None
    source_hidden: HiddenRef | None = None
    """The source's hidden states (a layer repair reads them); cut to the mapped positions where they live."""
    source: str | None = None
    """The member whose model a scattered-token repair reads to rank positions; None: the target alone."""
    importance: Tensor | None = None
    """Per-position scores already ranked on the source (`importance`): the repair reads these instead."""
    probe: ProbeCheck | None = None
    """The probe gate an adaptive repair (a ladder) climbs against, next to the target's weights."""
    sinks: int = 0
    """Leading positions made exact by a forward on the target before anything reads the map."""
    costs: PassCosts | None = None
    """The target's measured pass costs: a repair budget priced in seconds (None: in multiply-adds)."""


@dataclass(frozen=True)
class MapResult:
    """The mapped cache with its tail's logits and seconds, and what the repair did (None: no repair)."""

    computed: Computed
    repair: RepairSummary | None = None


@dataclass(frozen=True)
class MappingRequest:
    """The mapping `source` -> `target` from `store` (calibrated on demand if the store does that); setting
    `cancel` stops a calibration at its next forward pass."""

    source: str
    target: str
    store: MappingStore
    cancel: threading.Event | None = None


@dataclass(frozen=True)
class MappingResult:
    """A loaded mapping (a handle under a remote executor) and whether it was calibrated just now."""

    mapping: MappingRef
    calibrated: bool = False


@dataclass(frozen=True)
class ProbeReferenceRequest:
    """The pair's probe reference for `tail` trailing tokens: stored beside the mapping, else measured."""

    source: str
    target: str
    store: MappingStore
    mapping: MappingRef
    tail: int


@dataclass(frozen=True)
class ImportanceRequest:
    """How much `source`'s last `probe_tokens` tokens attend to each position of `cache` (`ids`'s positions)."""

    source: str
    cache: CacheRef
    ids: tuple[int, ...]
    probe_tokens: int
    focus: tuple[int, ...] | None = None
    """Tokens read after `ids` whose attention ranks the positions instead (a question-directed repair)."""


@dataclass(frozen=True)
class Importance:
    """One score per position (on the CPU, to ship to the target) and the seconds ranking took."""

    scores: Tensor
    seconds: float


@dataclass(frozen=True)
class PassCostsRequest:
    """`member`'s measured forward-pass costs, kept in `directory` (None: measured, not kept)."""

    member: str
    directory: str | None


@dataclass(frozen=True)
class EngineCache:
    """How an engine that keeps its own caches (vLLM with the family connector) holds a prefix: `Executor.engine_cache`."""

    path: str
    """``exact`` (its own prefill, or its own stored entry), ``mapped`` (another member's, through the map), or
    ``reprefilled`` (a map was refused, `reason` says why, and the engine computed the prefix itself)."""
    tokens: int
    """Prefix positions the engine did not compute for this request (loaded from its cache or the store)."""
    computed: int
    """Prefix positions the engine computed."""
    seconds: float
    """Wall seconds the engine took to hold the prefix."""
    source: str | None = None
    """The member whose cache was mapped."""
    gates: tuple[str, ...] = ()
    """The gates' verdicts on a map, ``"offline=pass"``."""
    reason: str | None = None
