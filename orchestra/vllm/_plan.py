"""What the connector's scheduler side tells its workers each step: which caches to load and which to save.

Plain frozen dataclasses, pickled by vLLM from the scheduler process to each worker with the step's
`SchedulerOutput`; tensors never travel this way (a worker reads them from the store or a hand-off file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from orchestra.familycache import Namespace, StoredEntry

__all__ = ["LoadSpec", "SaveSpec", "StepPlan", "LoadKind"]

LoadKind = Literal["exact", "mapped"]


@dataclass(frozen=True)
class LoadSpec:
    """Write token positions [start, stop) of a cache into a request's blocks before its forward pass."""

    request_id: str
    kind: LoadKind
    start: int
    stop: int
    block_ids: tuple[int, ...]
    stored: StoredEntry | None = None
    """An entry of the store (the worker's store reads it and checks its hash)."""
    handoff: str | None = None
    """A file written for this load alone (a mapped cache), removed once read."""


@dataclass(frozen=True)
class SaveSpec:
    """After this step, the request's prompt is computed: store its first `len(tokens)` positions."""

    request_id: str
    namespace: Namespace
    member: str
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass
class StepPlan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
