"""The web view of pipeline runs: the static page under ``/ui`` and the small JSON routes it reads.

Two hosts serve the same page. `orchestra serve` (``add_ui``): the page starts runs from the server's
``--pipelines`` folder and follows any run the server keeps. `orchestra run --ui` (``open_run_view``):
a server of its own on 127.0.0.1 shows the one run the command drives, from the same event log the
terminal display reads.

The page is plain files shipped in ``orchestra/serve/static`` (no build step, no CDN). The page itself
is public; every JSON route stays behind the server's API key, which the page sends as a Bearer header
(it reads the Server-Sent Events with ``fetch``, since ``EventSource`` cannot send headers).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.staticfiles import StaticFiles

from agents.bridge import in_thread, start_thread
from orchestra.errors import OrchestraError
from orchestra.serve._errors import ModelNotFound
from orchestra.serve._runs import RunNotFound, RunState, RunStatus
from orchestra.serve._schemas import ErrorBody

if TYPE_CHECKING:
    import uvicorn

    from orchestra.familycache import Entry, FamilyCache
    from orchestra.observability.events import Event
    from orchestra.observability.report import RunReport
    from orchestra.pipelines.spec import PipelineSpec
    from orchestra.serve._engine import ServeEngine
    from orchestra.serve._runs import RunManager, _Run

__all__ = ["UI_PATH", "add_ui", "is_ui_path", "open_run_view", "RunLog", "RunView",
           "UiOptionError"]

UI_PATH = "/ui"
STATIC_DIR = Path(__file__).with_name("static")
KEY_TOKENS = 64
"""Cached entries sharing their first KEY_TOKENS token ids are shown as one document (copies on each member)."""
PREVIEW_TOKENS = 24
VIEW_HOST = "127.0.0.1"


class UiOptionError(OrchestraError):
    """A mistake in `orchestra run --ui`'s options (exit 2, one line naming the fix)."""


def is_ui_path(path: str) -> bool:
    """The page's own files: public, so a browser can load the page that then asks for the key."""
    return path == UI_PATH or path.startswith(UI_PATH + "/")


# -- what the page reads ----------------------------------------------------------------------------------------------
class UiConfig(BaseModel):
    """What the page needs before its first API call (public: it holds no secret)."""

    mode: Literal["server", "run"] = Field(description="server: `orchestra serve`; run: `orchestra run --ui`.")
    auth: bool = Field(description="The JSON routes need `Authorization: Bearer <key>`.")
    can_start_runs: bool = Field(description="The page may start runs (POST /v1/runs).")
    run_id: str | None = Field(None, description="run mode: the run this view shows.")
    title: str = "orchestra"


class PipelineInput(BaseModel):
    name: str
    description: str = ""
    default: str | None = None


class PipelineNode(BaseModel):
    """An agent or a Python step of a pipeline's DAG."""

    name: str
    kind: Literal["agent", "step"]
    model: str | None = Field(None, description="The agent's model alias in the pipeline file.")
    member: str | None = Field(None, description="What the alias names: a member of the server's family, a folder, "
                               "a Hub id; None when it names nothing this server has.")
    upstream: list[str] = Field(default_factory=list, description="Nodes it reads or waits for.")


class PipelineInfo(BaseModel):
    """A pipeline the page can draw (and, on a server, start by `name`)."""

    name: str = Field(description="What POST /v1/runs takes as `pipeline` (the file's stem).")
    title: str = Field(description="The pipeline's own `name` (what runs report as their pipeline).")
    source: str | None = None
    nodes: list[PipelineNode] = Field(default_factory=list)
    inputs: list[PipelineInput] = Field(default_factory=list)
    error: str | None = Field(None, description="Why the file cannot run (it is listed all the same).")


class PipelineList(BaseModel):
    object: Literal["list"] = "list"
    data: list[PipelineInfo]


class RunSummary(BaseModel):
    id: str
    pipeline: str
    status: RunState
    created: int
    events: int


class RunList(BaseModel):
    object: Literal["list"] = "list"
    data: list[RunSummary] = Field(description="Newest first.")


class CachedCopy(BaseModel):
    """One member's cache of a document."""

    member: str
    kind: Literal["exact", "mapped"]
    source: str | None = Field(None, description="mapped: the member whose cache was mapped.")
    tokens: int
    bytes: int
    pinned: bool = Field(description="Leased right now (an agent or a request reads it).")
    on_disk: bool = Field(description="Read from, or written to, the disk tier.")


class CachedDocument(BaseModel):
    key: str = Field(description="Short hash of the leading token ids the copies share.")
    preview: str = Field(description="The start of the cached text.")
    tokens: int
    copies: list[CachedCopy]


class CacheView(BaseModel):
    """What the family-wide cache holds and how caches were obtained."""

    budget_bytes: int
    used_bytes: int
    entries: int
    hits: int = Field(description="Requests served from a cached prefix with no compute.")
    misses: int = Field(description="Requests that computed or mapped something.")
    joins: int = Field(description="Requests that waited for the same build in flight.")
    evictions: int
    hit_rate: float
    documents: list[CachedDocument]
    run_caches: dict[str, int] = Field(description="Caches of the kept runs' reports by path: exact, mapped, "
                                       "reprefilled.")
    run_fallbacks: int = Field(description="Agents of the kept runs re-prefilled after a refused map.")
    chat_lookups: dict[str, int] = Field(default_factory=dict, description="Chat prompts cached, by path.")


# -- building the answers ---------------------------------------------------------------------------------------------
def pipeline_info(name: str, spec: PipelineSpec, member_of: Callable[[str], str | None]) -> PipelineInfo:
    nodes = [PipelineNode(name=a.name, kind="agent", model=a.model, member=member_of(a.model), upstream=list(a.upstream))
             for a in spec.agents]
    nodes += [PipelineNode(name=s.name, kind="step", upstream=list(s.upstream)) for s in spec.steps]
    inputs = [PipelineInput(name=k, description=v.description, default=v.default) for k, v in spec.inputs.items()]
    return PipelineInfo(name=name, title=spec.name, source=spec.source_alias, nodes=nodes, inputs=inputs)


def folder_pipelines(folder: Path | None, member_of: Callable[[PipelineSpec, str], str | None]) -> list[PipelineInfo]:
    """Every pipeline file of the server's folder (the stems POST /v1/runs takes); a broken one says why."""
    from orchestra.pipelines.spec import load_pipeline

    if folder is None or not folder.is_dir():
        return []
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml", ".json"))
    out = []
    for path in files:
        try:
            spec = load_pipeline(path)
        except (OrchestraError, ValueError, ImportError, OSError) as exc:  # one bad file must not hide the others
            out.append(PipelineInfo(name=path.stem, title=path.stem, error=str(exc)[:500]))
            continue
        out.append(pipeline_info(path.stem, spec, functools.partial(member_of, spec)))
    return out


def _copy(entry: Entry) -> CachedCopy:
    mapped = entry.mapped
    return CachedCopy(member=entry.member, kind=entry.namespace.kind, source=mapped.source if mapped else None,
                      tokens=len(entry.tokens), bytes=entry.nbytes, pinned=entry.pins > 0, on_disk=entry.on_disk)


def _documents(cache: FamilyCache) -> list[CachedDocument]:
    """The cache's entries grouped by their leading tokens: one document, its copy on each member."""
    from orchestra.familycache import token_hash

    groups: dict[str, list[Entry]] = {}
    for entry in cache.pool.entries():
        groups.setdefault(token_hash(entry.tokens[:KEY_TOKENS])[:12], []).append(entry)
    documents = []
    for key, entries in groups.items():
        first = entries[0]
        try:
            preview = str(cache.executor.tokenizer(first.member).decode(list(first.tokens[:PREVIEW_TOKENS])))
        except (OSError, ValueError, KeyError):  # a tokenizer that cannot be read here: the numbers still stand
            preview = ""
        copies = sorted((_copy(e) for e in entries), key=lambda c: (c.member, c.kind, -c.tokens))
        documents.append(CachedDocument(key=key, preview=preview, tokens=max(c.tokens for c in copies), copies=copies))
    return documents


def cache_view(cache: FamilyCache, reports: Sequence[RunReport], chat_lookups: dict[str, int] | None = None) -> CacheView:
    stats = cache.stats
    paths = {"exact": 0, "mapped": 0, "reprefilled": 0}
    fallbacks = 0
    for report in reports:
        for record in report.caches:
            paths[record.path] += 1
        fallbacks += sum(1 for a in report.agents if a.fallback_reason)
    return CacheView(budget_bytes=cache.pool.budget_bytes, used_bytes=cache.used_bytes, entries=len(cache.pool),
                     hits=stats.hits, misses=stats.misses, joins=stats.joins, evictions=stats.evictions,
                     hit_rate=stats.hit_rate, documents=_documents(cache), run_caches=paths, run_fallbacks=fallbacks,
                     chat_lookups=chat_lookups or {})


def sse(kind: str, data: str) -> str:
    return f"event: {kind}\ndata: {data}\n\n"


def _mount_page(app: FastAPI, config: Callable[[], UiConfig]) -> None:
    """``/ui/config.json`` (before the mount, which would shadow it) and the page's files under ``/ui``."""

    @app.get(f"{UI_PATH}/config.json", response_model=UiConfig, include_in_schema=False)
    async def ui_config() -> UiConfig:
        return config()

    app.mount(UI_PATH, StaticFiles(directory=STATIC_DIR, html=True), name="ui")


# -- on `orchestra serve` ---------------------------------------------------------------------------------------------
def _kept_runs(manager: RunManager) -> list[_Run]:
    return manager.list()


def _chat_lookups(engine: ServeEngine) -> dict[str, int]:
    out: dict[str, int] = {}
    for metric in engine.metrics.lookups.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                path = sample.labels.get("path", "")
                out[path] = out.get(path, 0) + int(sample.value)
    return out


def _served_member(engine: ServeEngine, spec: PipelineSpec, alias: str) -> str | None:
    """The server member an alias runs on, as POST /v1/runs resolves it (by its target, else by the alias)."""
    target = spec.models.get(alias)
    for name in (target, alias):
        if isinstance(name, str):
            try:
                return engine.resolve(name)
            except ModelNotFound:
                continue
    return None


def add_ui(app: FastAPI, engine: Callable[[], Awaitable[ServeEngine]], *, auth: bool) -> None:
    """The page and its routes on `orchestra serve`'s app (the API key applies to the routes, not the page)."""
    errors: dict[int | str, dict[str, type[ErrorBody]]] = {401: {"model": ErrorBody}}

    @app.get("/v1/pipelines", response_model=PipelineList, responses=errors)
    async def list_pipelines() -> PipelineList:
        """The pipeline files POST /v1/runs can run by name (the server's --pipelines folder), with their DAGs."""
        served = await engine()
        folder = served.config.pipelines_dir
        found = await in_thread(folder_pipelines, folder, lambda spec, alias: _served_member(served, spec, alias))
        return PipelineList(data=found)

    # its own path: a GET route beside POST /v1/runs would answer a 405 there with `Allow: POST` only
    @app.get("/v1/ui/runs", response_model=RunList, responses=errors)
    async def list_runs() -> RunList:
        """The pipeline runs this server keeps (running, and the last finished ones), newest first."""
        runs = _kept_runs((await engine()).runs)
        return RunList(data=[RunSummary(id=r.id, pipeline=r.pipeline, status=r.status, created=r.created,
                                        events=len(r.events)) for r in reversed(runs)])

    @app.get("/v1/cache", response_model=CacheView, responses=errors)
    async def cache() -> CacheView:
        """The family-wide cache: documents held on which member (exact or mapped), hits, runs' cache paths."""
        served = await engine()
        reports = [run.report for run in _kept_runs(served.runs) if run.report is not None]
        return await in_thread(cache_view, served.cache, reports, _chat_lookups(served))

    _mount_page(app, lambda: UiConfig(mode="server", auth=auth, can_start_runs=True))


# -- on `orchestra run --ui` ------------------------------------------------------------------------------------------
class RunLog:
    """One run's events: appended by the command's event loop, read by the view's server on another thread."""

    def __init__(self, run_id: str, pipeline: str) -> None:
        self.run_id, self.pipeline = run_id, pipeline
        self.created = int(time.time())
        self.status: RunState = "running"
        self.error: str | None = None
        self.report: RunReport | None = None
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def append(self, event: Event) -> None:
        from orchestra.observability.events import RunFinished

        with self._lock:
            self._events.append(event)
            if isinstance(event, RunFinished) and event.report is not None:
                self.report = event.report
        self._wake()

    def finish_with(self, report: RunReport | None) -> None:
        """The final status from the run's report, worded as `orchestra serve` words a run's."""
        if report is None:
            self.finish("failed", "the run ended without a report")
            return
        bad = [f"{a.name} {a.status}" for a in report.agents if a.status != "succeeded"]
        self.finish("failed" if bad else "succeeded", ("agents did not succeed: " + ", ".join(bad)) if bad else None)

    def finish(self, status: RunState, error: str | None = None) -> None:
        with self._lock:
            if self.status == "running":
                self.status, self.error = status, error
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, changed in waiters:
            with contextlib.suppress(RuntimeError):  # the view's loop already closed: nobody left to tell
                loop.call_soon_threadsafe(changed.set)

    def status_model(self) -> RunStatus:
        with self._lock:
            return RunStatus(id=self.run_id, pipeline=self.pipeline, status=self.status, created=self.created,
                             events=len(self._events),
                             report=self.report.model_dump(mode="json") if self.report else None, error=self.error)

    async def frames(self) -> AsyncIterator[str]:
        """SSE frames as `orchestra serve` sends them: every event so far, each new one, then `end`."""
        sent = 0
        while True:
            changed = asyncio.Event()
            waiter = (asyncio.get_running_loop(), changed)
            with self._lock:  # registered before reading, so an event appended after the read wakes it
                self._waiters.add(waiter)
                batch, status = self._events[sent:], self.status
            try:
                for event in batch:
                    yield sse(event.kind, event.model_dump_json())
                sent += len(batch)
                if status != "running":
                    yield sse("end", json.dumps({"id": self.run_id, "status": status, "error": self.error}))
                    return
                if not batch:
                    await changed.wait()
            finally:
                with self._lock:
                    self._waiters.discard(waiter)


def run_view_app(log: RunLog, pipeline: PipelineInfo, cache: FamilyCache) -> FastAPI:
    """The page and the routes it reads, over one run's log (no key: it listens on 127.0.0.1 only)."""
    app = FastAPI(title="orchestra run", docs_url=None, redoc_url=None, openapi_url=None)

    def known(run_id: str) -> None:
        if run_id != log.run_id:
            raise RunNotFound(f"this view shows run {log.run_id} only", param="id")

    @app.exception_handler(RunNotFound)
    async def not_found(request: Request, exc: RunNotFound) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/v1/pipelines", response_model=PipelineList)
    async def list_pipelines() -> PipelineList:
        return PipelineList(data=[pipeline])

    @app.get("/v1/ui/runs", response_model=RunList)
    async def list_runs() -> RunList:
        status = log.status_model()
        return RunList(data=[RunSummary(id=status.id, pipeline=status.pipeline, status=status.status,
                                        created=status.created, events=status.events)])

    @app.get("/v1/runs/{run_id}", response_model=RunStatus)
    async def run_status(run_id: str) -> RunStatus:
        known(run_id)
        return log.status_model()

    @app.get("/v1/runs/{run_id}/events")
    async def run_events(run_id: str) -> StreamingResponse:
        known(run_id)
        return StreamingResponse(log.frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/cache", response_model=CacheView)
    async def cache_route() -> CacheView:
        reports = [log.report] if log.report is not None else []
        return await in_thread(cache_view, cache, reports)

    _mount_page(app, lambda: UiConfig(mode="run", auth=False, can_start_runs=False, run_id=log.run_id,
                                      title=f"orchestra run {log.run_id}"))
    return app


class RunView:
    """`orchestra run --ui`: the view's uvicorn server on a thread of its own, with its own event loop (the
    run's loop and its Ctrl-C stay the command's), on a socket bound before the URL is printed."""

    def __init__(self, app: FastAPI, port: int) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port just freed (TIME_WAIT), never a taken one
        try:
            sock.bind((VIEW_HOST, port))
        except OSError as exc:
            sock.close()
            raise UiOptionError(f"--ui-port {port}: {exc.strerror or exc}; pick another port, or 0 for a free one") \
                from exc
        sock.listen(64)
        self._socket = sock
        self.url = f"http://{VIEW_HOST}:{sock.getsockname()[1]}{UI_PATH}/"
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        self._server: uvicorn.Server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> None:
        self._thread = start_thread(self._server.run, name="orchestra-ui", kwargs={"sockets": [self._socket]})
        deadline = time.monotonic() + timeout
        while not self._server.started:  # uvicorn says nothing else when it is up
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise UiOptionError(f"the web view did not start on {self.url}; run without --ui, or pick "
                                    "another --ui-port")
            time.sleep(0.02)

    def serve_until_interrupted(self) -> None:
        """Block until Ctrl-C or SIGTERM: the run is over, the view stays up for whoever still reads it."""
        stop = threading.Event()

        def handler(signum: int, frame: FrameType | None) -> None:
            stop.set()

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while self._thread is not None and self._thread.is_alive() and not stop.wait(0.2):
                pass
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def close(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10.0)
        self._socket.close()


@contextlib.contextmanager
def open_run_view(spec: PipelineSpec, cache: FamilyCache, run_id: str, *, port: int = 0) -> Iterator[tuple[RunView, RunLog]]:
    """Serve the view of run `run_id` while the block runs; the caller appends the run's events to the log.

    Leaving the block ends the log (failed or cancelled when the block raised) and stops the server once
    every open event stream has sent its end.
    """
    log = RunLog(run_id, spec.name)
    info = pipeline_info(spec.name, spec, lambda alias: str(spec.models[alias]) if alias in spec.models else None)
    view = RunView(run_view_app(log, info, cache), port)
    view.start()
    try:
        yield view, log
    except KeyboardInterrupt:
        log.finish("cancelled", "interrupted")
        raise
    except BaseException as exc:
        log.finish("failed", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        log.finish("failed", "the command ended before the run finished")
        view.close()
