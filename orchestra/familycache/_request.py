"""A cache request in flight, and the builds requests share: the state the parts of FamilyCache pass around."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestra.errors import OrchestraError
from orchestra.familycache._events import CacheStep

if TYPE_CHECKING:
    from mappings.repair import RepairPolicy
    from orchestra.familycache._pool import Entry, Namespace
    from orchestra.familycache._records import MappedFrom
    from orchestra.familycache.gates import GateDecision, GatePolicy
    from orchestra.models.registry import ModelInfo

__all__ = ["CacheRequest", "Flight", "MappingFailed", "mapped_of", "variant_of", "why"]


class Flight:
    """A build in progress: `ids` on the member(s) of `member_ns`, exact (`variant` None) or mapped."""

    def __init__(self, member_ns: Namespace, ids: tuple[int, ...], variant: str | None) -> None:
        self.member_ns = member_ns
        """The exact namespace of the member it builds for (a map's own namespace needs the loaded mapping)."""
        self.ids = ids
        self.variant = variant
        """For a mapped build: the probe tail and repair policy that shape it (as `Namespace.variant`)."""
        self.done = threading.Event()
        self.entry: Entry | None = None
        self.error: BaseException | None = None


@dataclass
class CacheRequest:
    member: str
    info: ModelInfo
    ids: tuple[int, ...]
    gate: GatePolicy
    repair: RepairPolicy | None
    tail: int
    sink: Callable[[CacheStep], None]
    cancel: threading.Event | None = None
    steps: list[CacheStep] = field(default_factory=list)
    prefill_s: float = 0.0
    map_s: float = 0.0
    pinned: list[Entry] = field(default_factory=list)
    decisions: list[GateDecision] = field(default_factory=list)
    joined: set[int] = field(default_factory=set)
    """Entries built by a flight of exactly these tokens this request waited for (served from them: not a hit)."""
    inline_tail: int = 0
    """The caller computes up to this many trailing tokens itself: the request may shrink to a shared prefix."""
    load_s: float = 0.0
    loaded_tokens: int = 0
    saved_s: float = 0.0

    def step(self, step: CacheStep) -> None:
        self.steps.append(step)
        self.sink(step)


class MappingFailed(Exception):
    """A mapping could not be loaded or applied: a gate failure, never an agent failure."""


def variant_of(req: CacheRequest) -> str:
    """What shapes a mapped build besides its tokens (`Namespace.variant`): the probe tail and the repair policy."""
    repair = req.repair
    if repair is None or (repair.budget == 0 and not repair.adaptive):
        return f"tail={req.tail}"
    if repair.adaptive:  # where a ladder stops depends on the gate it climbs against
        gate = req.gate.model_dump_json(include={"offline", "probe"})
        return f"tail={req.tail};{repair.model_dump_json()};gate={gate}"
    return f"tail={req.tail};{repair.model_dump_json()}"


def why(exc: BaseException) -> str:
    """An exception as a reason: the project's typed errors by message, anything else with its type."""
    from mappings.errors import MappingError

    if isinstance(exc, (OrchestraError, MappingError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def mapped_of(entry: Entry) -> MappedFrom:
    """What a mapped entry knows of how it was made (an entry reached by a mapped route always has it)."""
    assert entry.mapped is not None, "a mapped route reached an exact entry"
    return entry.mapped

