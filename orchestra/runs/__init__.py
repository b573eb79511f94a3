"""Runs: one pipeline over one document, from the shared prefill to the report.

Owns the scheduler (`Orchestra`: the DAG walk, each agent as its own task as soon as its upstreams
finish), a run's typed state, chunked map-reduce over documents longer than a window, sessions (one
document held for many runs) and checkpoints (a stopped run resumes where it stopped).

May import: ``orchestra.pipelines``, ``orchestra.observability``, ``orchestra.familycache``,
``orchestra.family.manifest``, ``orchestra.documents``, ``orchestra.models`` and below. The server
and the Python builder stand on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestra._exports import lazy_exports

if TYPE_CHECKING:
    from orchestra.runs._loop import refuse_inside_event_loop
    from orchestra.runs.checkpoint import Checkpointer, MemoryCheckpointer, RunCheckpoint, SqliteCheckpointer
    from orchestra.runs.scheduler import Orchestra
    from orchestra.runs.session import Session

__all__ = [
    "Orchestra",
    "Session",
    "Checkpointer",
    "MemoryCheckpointer",
    "SqliteCheckpointer",
    "RunCheckpoint",
    "refuse_inside_event_loop",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "orchestra.runs._loop": ("refuse_inside_event_loop",),
        "orchestra.runs.checkpoint": (
            "Checkpointer",
            "MemoryCheckpointer",
            "RunCheckpoint",
            "SqliteCheckpointer",
        ),
        "orchestra.runs.scheduler": ("Orchestra",),
        "orchestra.runs.session": ("Session",),
    },
)
