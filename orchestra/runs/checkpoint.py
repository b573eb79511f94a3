"""Durable runs: each finished agent's report and output recorded under the run id, so a run that stopped
(killed, interrupted, crashed) resumes where it stopped instead of starting again from the first agent.

A checkpoint belongs to one pipeline, document and set of inputs (their digests are recorded when the run
begins): resuming it with another is refused, never silently mixed. Only agents that succeeded or were
judged degenerate are restored (greedy decoding makes their outputs what a rerun would give); failed,
skipped and unfinished agents run again. `SqliteCheckpointer` commits each record before the run goes on,
so a SIGKILL loses at most the agent that was running.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, Field

from orchestra.errors import RunResumeError
from orchestra.observability.report import AgentReport

__all__ = ["Checkpointer", "MemoryCheckpointer", "SqliteCheckpointer", "RunCheckpoint", "RunIdentity",
           "RESTORABLE", "document_digest", "pipeline_digest"]

RESTORABLE = ("succeeded", "degenerate")
"""Agent statuses a resumed run keeps instead of running the agent again."""


def document_digest(document: str) -> str:
    return hashlib.sha256(document.encode("utf-8", "surrogatepass")).hexdigest()


class RunIdentity(BaseModel):
    """What a checkpoint is of: a resumed run must match it exactly."""

    pipeline: str
    """The pipeline's name (for people; the digest decides)."""
    pipeline_digest: str
    """sha256 of the validated pipeline spec."""
    document_digest: str
    inputs: dict[str, str] = Field(default_factory=dict)

    def mismatch(self, other: RunIdentity) -> str | None:
        """What differs from `other`, as the fix a user needs; None when they match."""
        if self.pipeline_digest != other.pipeline_digest:
            return f"pipeline {other.pipeline!r} is not the pipeline {self.pipeline!r} the run was started with"
        if self.document_digest != other.document_digest:
            return "the document differs from the one the run was started with"
        if self.inputs != other.inputs:
            return f"the inputs differ from the run's {self.inputs}"
        return None


class RunCheckpoint(BaseModel):
    """One run as recorded: its identity, the agents that finished (reports and downstream outputs), whether it ended."""

    run_id: str
    identity: RunIdentity
    agents: dict[str, AgentReport] = Field(default_factory=dict)
    outputs: dict[str, str] = Field(default_factory=dict)
    """The text each succeeded agent handed downstream."""
    finished: bool = False
    started_at: float = 0.0


class Checkpointer(ABC):
    """Where a run records its progress; the scheduler calls these from its event loop (keep them quick)."""

    @abstractmethod
    def get(self, run_id: str) -> RunCheckpoint | None:
        """The run's checkpoint, or None when there is none under that id."""

    @abstractmethod
    def begin(self, run_id: str, identity: RunIdentity) -> None:
        """A run starts (or resumes) under `run_id`; a new id is recorded with its identity."""

    @abstractmethod
    def record(self, run_id: str, report: AgentReport, output: str | None) -> None:
        """An agent of the run finished (any status); `output` is what it hands downstream (None if nothing)."""

    @abstractmethod
    def finish(self, run_id: str) -> None:
        """The run ended with every agent accounted for."""

    def resume_state(self, run_id: str, identity: RunIdentity, *, must_exist: bool = False) -> RunCheckpoint | None:
        """The checkpoint to continue from (None: a new run); RunResumeError when it is another run's."""
        found = self.get(run_id)
        if found is None:
            if must_exist:
                raise RunResumeError(f"no run {run_id!r} to resume in {self}: start it without --resume "
                                     "(its id is printed when it starts)")
            return None
        why = found.identity.mismatch(identity)
        if why is not None:
            raise RunResumeError(f"run {run_id!r} cannot be resumed: {why}; resume it with what it was started "
                                 "with, or start a new run")
        return found


class MemoryCheckpointer(Checkpointer):
    """Checkpoints in this process's memory (a run resumes after an exception, not after the process ends)."""

    def __init__(self) -> None:
        self._runs: dict[str, RunCheckpoint] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "memory"

    def get(self, run_id: str) -> RunCheckpoint | None:
        with self._lock:
            found = self._runs.get(run_id)
            return found.model_copy(deep=True) if found is not None else None

    def begin(self, run_id: str, identity: RunIdentity) -> None:
        with self._lock:
            self._runs.setdefault(run_id, RunCheckpoint(run_id=run_id, identity=identity, started_at=time.time()))

    def record(self, run_id: str, report: AgentReport, output: str | None) -> None:
        with self._lock:
            run = self._runs[run_id]
            run.agents[report.name] = report.model_copy(deep=True)
            if output is not None:
                run.outputs[report.name] = output

    def finish(self, run_id: str) -> None:
        with self._lock:
            self._runs[run_id].finished = True


class SqliteCheckpointer(Checkpointer):
    """Checkpoints in a SQLite file (stdlib sqlite3, WAL): several processes may share it; every record is committed."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        with self._conn() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, identity TEXT NOT NULL, "
                         "started_at REAL NOT NULL, finished INTEGER NOT NULL DEFAULT 0)")
            conn.execute("CREATE TABLE IF NOT EXISTS agents (run_id TEXT NOT NULL, name TEXT NOT NULL, "
                         "report TEXT NOT NULL, output TEXT, PRIMARY KEY (run_id, name))")

    def __repr__(self) -> str:
        return str(self.path)

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30.0)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
        return conn

    def get(self, run_id: str) -> RunCheckpoint | None:
        conn = self._conn()
        row = conn.execute("SELECT identity, started_at, finished FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            return None
        run = RunCheckpoint(run_id=run_id, identity=RunIdentity.model_validate_json(row[0]), started_at=row[1],
                            finished=bool(row[2]))
        for name, report, output in conn.execute("SELECT name, report, output FROM agents WHERE run_id = ?",
                                                 (run_id,)):
            run.agents[name] = AgentReport.model_validate_json(report)
            if output is not None:
                run.outputs[name] = output
        return run

    def begin(self, run_id: str, identity: RunIdentity) -> None:
        with self._conn() as conn:
            conn.execute("INSERT OR IGNORE INTO runs (run_id, identity, started_at) VALUES (?, ?, ?)",
                         (run_id, identity.model_dump_json(), time.time()))

    def record(self, run_id: str, report: AgentReport, output: str | None) -> None:
        with self._conn() as conn:
            conn.execute("INSERT OR REPLACE INTO agents (run_id, name, report, output) VALUES (?, ?, ?, ?)",
                         (run_id, report.name, report.model_dump_json(), output))

    def finish(self, run_id: str) -> None:
        with self._conn() as conn:
            conn.execute("UPDATE runs SET finished = 1 WHERE run_id = ?", (run_id,))

    def runs(self) -> list[tuple[str, RunIdentity, float, bool, int]]:
        """Every recorded run, newest first: id, identity, start time, finished, agents recorded."""
        rows = self._conn().execute(
            "SELECT r.run_id, r.identity, r.started_at, r.finished, COUNT(a.name) FROM runs r "
            "LEFT JOIN agents a ON a.run_id = r.run_id GROUP BY r.run_id ORDER BY r.started_at DESC").fetchall()
        return [(r[0], RunIdentity.model_validate_json(r[1]), r[2], bool(r[3]), r[4]) for r in rows]


def pipeline_digest(spec_json: str | Mapping[str, object]) -> str:
    """sha256 of a pipeline spec's canonical JSON."""
    text = spec_json if isinstance(spec_json, str) else json.dumps(spec_json, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
