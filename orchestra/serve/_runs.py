"""Pipeline runs over HTTP: ``POST /v1/runs`` starts one on the server's FamilyCache, its typed events are
kept (replayable from the start as Server-Sent Events), ``GET`` gives its status and report, ``DELETE``
cancels it.

A served pipeline runs on the server's family: its `models` name members (by role or name), never
folders or Hub ids, and it shares the server's caches with chat requests (a document a chat cached is
reused by a run, and back). Finished runs are kept, the oldest forgotten beyond `keep`.

A pipeline sent inline is the client's, not the operator's: before it is built, its raw data is read for the
Python it names and the folders it sets (`orchestra.pipelines.trust`), and what the server's `CodePolicy` does not allow
is answered 403 with nothing imported; it is then built, and run, under that policy. A pipeline from the
operator's ``--pipelines`` folder is the operator's own and may name any Python.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import anyio
from pydantic import BaseModel, ConfigDict, Field

from agents.errors import CodeNotAllowedError
from agents.references import UNRESTRICTED, CodePolicy, code_policy
from orchestra._logging import get_logger
from orchestra.errors import OrchestraError
from orchestra.serve._errors import ApiError, BadRequest, Forbidden, RateLimited

if TYPE_CHECKING:
    from orchestra.family.manifest import FamilyManifest
    from orchestra.familycache import FamilyCache
    from orchestra.observability.events import Event
    from orchestra.observability.metrics import PipelineMetrics
    from orchestra.observability.report import RunReport
    from orchestra.pipelines.spec import PipelineSpec
    from orchestra.runs.scheduler import Orchestra

__all__ = ["RunRequest", "RunStatus", "RunManager", "RunNotFound", "RunConflict"]

log = get_logger("orchestra.serve.runs")
_PIPELINE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
RunState = Literal["running", "succeeded", "failed", "cancelled"]


class RunHost(Protocol):
    """What runs need of the server's engine (a structural type: the engine imports this module)."""

    family: FamilyManifest
    cache: FamilyCache

    def resolve(self, model: str) -> str: ...


class RunNotFound(ApiError):
    status, code = 404, "run_not_found"


class RunConflict(ApiError):
    status, code = 409, "run_finished"


class RunRequest(BaseModel):
    """A pipeline run to start: a pipeline by name (a file in the server's --pipelines folder) or inline."""

    model_config = ConfigDict(extra="forbid")
    pipeline: str | None = Field(None, description="Name of a pipeline file in the server's pipelines folder (its "
                                 "stem: `qa` for qa.yaml).")
    spec: dict[str, object] | None = Field(None, description="An inline pipeline, as a pipeline file's content. It "
                                           "may name Python (steps, tools, output models) only in the modules the "
                                           "server allows (`--allow-code`); else 403.")
    document: str = Field(min_length=1, description="The document's text (never a path: the server reads no file "
                          "a request names).")
    inputs: dict[str, str] = Field(default_factory=dict, description="Values of the pipeline's declared inputs.")


class RunStatus(BaseModel):
    """Where a run is: its state, its report once finished, or why it failed."""

    id: str
    object: Literal["pipeline.run"] = "pipeline.run"
    pipeline: str
    status: RunState
    created: int
    events: int = Field(description="Events so far (GET /v1/runs/{id}/events replays them).")
    report: dict[str, builtins.object] | None = None
    error: str | None = None


@dataclass
class _Run:
    id: str
    pipeline: str
    created: int
    status: RunState = "running"
    events: list[Event] = field(default_factory=list)
    report: RunReport | None = None
    error: str | None = None
    changed: anyio.Event = field(default_factory=anyio.Event)
    task: asyncio.Task[None] | None = None

    def publish(self) -> None:
        """Wake every events reader (each waits on the event it was given)."""
        changed, self.changed = self.changed, anyio.Event()
        changed.set()

    def status_model(self) -> RunStatus:
        return RunStatus(id=self.id, pipeline=self.pipeline, status=self.status, created=self.created,
                         events=len(self.events), report=self.report.model_dump(mode="json") if self.report else None,
                         error=self.error)


class RunManager:
    """The server's pipeline runs: started, followed, cancelled; at most `max_running` at once."""

    def __init__(self, engine: RunHost, *, pipelines_dir: Path | None = None, max_running: int = 4,
                 keep: int = 100, metrics: PipelineMetrics | None = None, code: CodePolicy | None = None) -> None:
        self.engine = engine
        self.code = code or CodePolicy()
        """What inline pipelines may import (default: nothing but the built-in tools)."""
        self.metrics = metrics
        """Where runs are counted (the server's registry: /metrics shows runs beside chat requests)."""
        self.pipelines_dir = pipelines_dir
        self.max_running = max_running
        self.keep = keep
        self._runs: OrderedDict[str, _Run] = OrderedDict()

    def list(self) -> list[_Run]:
        """The runs kept (running and finished), oldest first."""
        return list(self._runs.values())

    # -- starting -------------------------------------------------------------------------------------------------
    def start(self, body: RunRequest) -> RunStatus:
        if (body.pipeline is None) == (body.spec is None):
            raise BadRequest("give exactly one of `pipeline` (a name from the server's pipelines folder) or `spec` "
                             "(an inline pipeline)", param="pipeline")
        # The run is built and started under the policy of whoever wrote the pipeline: the task created below
        # copies this context, so anything the run imports later is held to the same policy.
        with code_policy(UNRESTRICTED if body.pipeline is not None else self.code):
            try:
                return self._start(body)
            except CodeNotAllowedError as exc:  # refused by the raw reading, or at import for what it did not know
                raise Forbidden(str(exc), param="spec") from exc

    def _start(self, body: RunRequest) -> RunStatus:
        spec = self._spec(body)
        running = sum(1 for r in self._runs.values() if r.status == "running")
        if running >= self.max_running:
            raise RateLimited(f"{running} pipeline runs are running (the server's limit); retry when one ends",
                              retry_after=30)
        from orchestra.pipelines.inputs import resolve_inputs
        from orchestra.runs.scheduler import Orchestra

        try:
            inputs = resolve_inputs(spec.inputs, body.inputs)
            orchestra = Orchestra(spec, family=self.engine.family, cache=self.engine.cache)
        except OrchestraError as exc:
            raise BadRequest(str(exc), param="inputs" if "input" in type(exc).__name__.lower() else "spec") from exc
        run = _Run(uuid.uuid4().hex[:16], spec.name, int(time.time()))
        self._runs[run.id] = run
        self._forget_old()
        run.task = asyncio.get_running_loop().create_task(self._drive(run, orchestra, body.document, inputs))
        return run.status_model()

    def _spec(self, body: RunRequest) -> PipelineSpec:
        """The pipeline to run, its models translated to the server's members (roles)."""
        from pydantic import ValidationError

        from orchestra.pipelines.spec import PipelineSpec, load_pipeline
        from orchestra.pipelines.trust import check_client_spec

        if body.spec is not None:
            check_client_spec(body.spec, self.code)  # before anything in it is imported (`start` answers 403)
        path = self._pipeline_file(body.pipeline) if body.pipeline is not None else None
        try:
            if path is not None:
                spec = load_pipeline(path)
            else:
                spec = PipelineSpec.model_validate({"name": "inline", **(body.spec or {})})
        except (OrchestraError, ValidationError, ValueError) as exc:
            raise BadRequest(f"the pipeline is not valid: {exc}", param="spec") from exc
        # an operator's file written for `orchestra run` (models as folders) runs on the members its aliases name;
        # a client's pipeline gets the members it names or an error, never a model it did not ask for
        return self._on_members(spec, by_alias=path is not None)

    def _pipeline_file(self, name: str) -> Path:
        folder = self.pipelines_dir
        if folder is None:
            raise BadRequest("this server has no pipelines folder (start it with --pipelines DIR): send the "
                             "pipeline inline as `spec`", param="pipeline")
        if not _PIPELINE_NAME.fullmatch(name):  # a stem in the folder, never a path out of it
            raise BadRequest(f"{name!r} is not a pipeline name: give the stem of a file in the server's pipelines "
                             "folder (letters, digits, '_', '-', '.'), as GET /v1/pipelines lists them",
                             param="pipeline")
        known = sorted(p.stem for p in folder.glob("*.y*ml")) + sorted(p.stem for p in folder.glob("*.json"))
        for suffix in (".yaml", ".yml", ".json"):
            path = folder / f"{name}{suffix}"
            if path.is_file() and path.parent == folder:
                return path
        raise BadRequest(f"no pipeline named {name!r} in the server's pipelines folder; it has "
                         f"{', '.join(known) or 'none'}", param="pipeline")

    def _on_members(self, spec: PipelineSpec, *, by_alias: bool) -> PipelineSpec:
        """The spec with every alias replaced by the server member it names (runs share the server's cache); with
        `by_alias`, a target that is no member (a folder) is taken as the member its alias names."""
        from orchestra.serve._errors import ModelNotFound

        roles: dict[str, str] = {}
        for alias, target in spec.models.items():
            if not isinstance(target, str):
                raise BadRequest(f"models.{alias}: a served pipeline runs on the server's family; adapters and "
                                 "quantized views are not members of it", param="spec")
            try:
                roles[alias] = self.engine.resolve(target)
            except ModelNotFound:
                try:
                    if not by_alias:
                        raise
                    roles[alias] = self.engine.resolve(alias)
                except ModelNotFound as exc:
                    raise BadRequest(f"models.{alias}: {target!r} is not a member of this server's family "
                                     f"(GET /v1/models lists them)", param="spec") from exc
        data = spec.model_dump(mode="python")
        data["models"] = {role: role for role in roles.values()}
        data["source"] = roles[spec.source_alias]
        for agent in data["agents"]:
            agent["model"] = roles[agent["model"]]
        from orchestra.pipelines.spec import PipelineSpec

        return PipelineSpec.model_validate(data)

    async def _drive(self, run: _Run, orchestra: Orchestra, document: str, inputs: dict[str, str]) -> None:
        counted = self.metrics.sink(run.pipeline) if self.metrics is not None else None

        async def collect(event: Event) -> None:
            run.events.append(event)
            run.publish()
            if counted is not None:
                counted(event)

        try:
            run.report = await orchestra.run(document, on_event=collect, run_id=run.id, inputs=inputs)
            run.status = "succeeded" if all(a.status == "succeeded" for a in run.report.agents) else "failed"
            if run.status == "failed":
                bad = [f"{a.name} {a.status}" for a in run.report.agents if a.status != "succeeded"]
                run.error = "agents did not succeed: " + ", ".join(bad)
        except asyncio.CancelledError:
            run.status, run.error = "cancelled", "cancelled by DELETE /v1/runs/{id}"
            if counted is not None:
                counted.ended_without_report("cancelled")
            raise
        except Exception as exc:  # a document too long for a member, an executor failure: the run's, not ours
            run.status, run.error = "failed", f"{type(exc).__name__}: {exc}"
            if counted is not None:
                counted.ended_without_report("failed")
            log.warning("pipeline_run_failed", run=run.id, error=run.error)
        finally:
            run.publish()

    # -- reading ----------------------------------------------------------------------------------------------------
    def get(self, run_id: str) -> RunStatus:
        return self._run(run_id).status_model()

    async def events(self, run_id: str) -> AsyncIterator[str]:
        """The run's events as SSE frames: every one so far, then each new one until the run ends."""
        run = self._run(run_id)
        sent = 0
        while True:
            changed = run.changed
            while sent < len(run.events):
                event = run.events[sent]
                sent += 1
                yield f"event: {event.kind}\ndata: {event.model_dump_json()}\n\n"
            if run.status != "running":
                yield f"event: end\ndata: {json.dumps({'id': run.id, 'status': run.status, 'error': run.error})}\n\n"
                return
            await changed.wait()

    async def cancel(self, run_id: str) -> RunStatus:
        run = self._run(run_id)
        if run.status != "running" or run.task is None:
            raise RunConflict(f"run {run_id} already ended ({run.status}); nothing to cancel")
        run.task.cancel()
        with anyio.CancelScope(shield=True):
            try:
                await run.task
            except asyncio.CancelledError:
                pass
        if run.status == "running":  # cancelled before its first step: its own handler never ran
            run.status, run.error = "cancelled", "cancelled by DELETE /v1/runs/{id}"
            run.publish()
        return run.status_model()

    def _run(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            raise RunNotFound(f"no pipeline run {run_id!r} on this server (finished runs are kept for the last "
                              f"{self.keep})", param="id")
        return run

    def _forget_old(self) -> None:
        finished = [rid for rid, r in self._runs.items() if r.status != "running"]
        for rid in finished[: max(0, len(self._runs) - self.keep)]:
            del self._runs[rid]

    def close(self) -> None:
        for run in self._runs.values():
            if run.task is not None and not run.task.done():
                run.task.cancel()

