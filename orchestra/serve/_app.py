"""The OpenAI-compatible HTTP API (FastAPI), over a ServeEngine.

    orchestra serve --port 8000                          # or, to embed:
    app = create_app(ServeConfig(cache_mb=1024))         # mount it in your own ASGI app

Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}``; a client's mistake
is a 4xx, never a 500, and one request's failure never touches another's stream.
"""

from __future__ import annotations

import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import ContentStream
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agents.bridge import in_thread
from orchestra._logging import get_logger
from orchestra.errors import ActorLostError, ExecutorError
from orchestra.serve._config import ServeConfig
from orchestra.serve._engine import Generation, ServeEngine
from orchestra.serve._errors import ApiError, ExecutorFailed, PayloadTooLarge, Unauthorized
from orchestra.serve._runs import RunRequest, RunStatus
from orchestra.serve._schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    ErrorBody,
    ModelCard,
    ModelList,
    PrefillRequest,
    PrefillResponse,
    ToolCallDelta,
    Usage,
    allowed_range,
)
from orchestra.serve._tools import read_tool_reply
from orchestra.serve._ui import add_ui, is_ui_path

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = ["create_app"]

log = get_logger("orchestra.serve.access")
OPEN_PATHS = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
# Keys typed int | str: FastAPI takes the mapping invariantly as dict[int | str, ...].
ERRORS: dict[int | str, dict[str, type[ErrorBody]]] = {
    400: {"model": ErrorBody}, 401: {"model": ErrorBody}, 403: {"model": ErrorBody}, 404: {"model": ErrorBody},
    413: {"model": ErrorBody},
    429: {"model": ErrorBody}, 503: {"model": ErrorBody}, 504: {"model": ErrorBody}}
STREAMED = {"description": "A chat.completion object, or with stream=true Server-Sent Events: one `data: "
                           "<chat.completion.chunk JSON>` per piece of text, then `data: [DONE]`.",
            "content": {"text/event-stream": {"schema": {  # one event (OpenAPI 3.1 reads an SSE schema per event)
                "type": "object", "required": ["data"],
                "properties": {"data": {"type": "string", "description": "a chat.completion.chunk as JSON, an "
                                        "{\"error\": ...} object if the stream fails after it began, or [DONE]"}}}}}}


class _BodyLimit:
    """Refuse bodies over the limit (413) without reading them whole: by Content-Length, then while reading.

    The body is read here (it is small: at most the limit) and handed on whole, so a chunked body over the
    limit is a 413 too; raising from inside `receive` would reach FastAPI's body parser, which answers 400.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        too_large = PayloadTooLarge(f"the request body is larger than this server's {self.limit} bytes; send less")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _error_response(too_large)(scope, receive, send)
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body: nobody to answer
                return None
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.limit:
                return await _error_response(too_large)(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later: http.disconnect, which stops a generation

        return await self.app(scope, replay, send)


class _ClosingStream(StreamingResponse):
    """A streamed reply that closes its generation when the response ends, however it ends.

    The reply's own generator closes it when it runs to the end or is closed; a hang-up can leave the
    generator suspended and referenced (by a logged traceback, say), so its row would decode on for nobody.
    Ending here does not wait for the generator to be collected.
    """

    def __init__(self, content: ContentStream, *, on_end: Callable[[], Awaitable[None]], status_code: int = 200,
                 headers: Mapping[str, str] | None = None, media_type: str | None = None,
                 background: BackgroundTask | None = None) -> None:
        super().__init__(content, status_code=status_code, headers=headers, media_type=media_type,
                         background=background)
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_end()


class _ApiKey:
    """401 for a request without the server's bearer key, except on the open paths (health, metrics, docs).

    A plain ASGI middleware, not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware runs the
    route in a task of its own, and when a streaming client hangs up mid-reply its cancel scopes can
    unwind out of order ("Attempted to exit a cancel scope that isn't the current task's"), leaving the
    reply's generator unclosed and its row decoding to max_tokens for nobody (seen in CI).
    """

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope) if scope["type"] == "http" else None
        # the web view's own files are public (its JSON routes are not): the page asks for the key
        if request is None or _local_path(request) in OPEN_PATHS or is_ui_path(_local_path(request)):
            return await self.app(scope, receive, send)
        given = request.headers.get("authorization", "")
        kind, _, token = given.partition(" ")
        if kind.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
            return await _error_response(Unauthorized("missing or wrong API key: send 'Authorization: Bearer <key>'"))(
                scope, receive, send)
        return await self.app(scope, receive, send)


class _AccessLog:
    """One structured line per request: method, path, status, milliseconds, request id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [500]
        request_id = _incoming_request_id(scope) or uuid.uuid4().hex[:16]

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            log.info("request", method=scope.get("method"), path=scope.get("path"), status=status[0],
                     ms=round((time.perf_counter() - started) * 1000, 1), request_id=request_id)


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


def _incoming_request_id(scope: Scope) -> str | None:
    """The client's ``x-request-id`` when it is a sane token (kept and echoed, so logs on both sides join up)."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"x-request-id":
            text = value.decode("latin-1").strip()
            return text if _REQUEST_ID.match(text) else None
    return None


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers() or None)


class _EngineSlot:
    """The app's engine: the one handed in, or one built from the config at first need (at start-up under
    uvicorn, or at the first request when the app is mounted in another one: Starlette runs no lifespan of
    a mounted app)."""

    def __init__(self, config: ServeConfig, engine: ServeEngine | None) -> None:
        self.config = config
        self.engine = engine
        self.owned = False  # an engine handed in belongs to the caller, who closes it
        self._building = anyio.Lock()

    async def get(self) -> ServeEngine:
        if self.engine is None:
            async with self._building:
                if self.engine is None:
                    self.engine = await in_thread(ServeEngine, self.config)
                    self.owned = True
        return self.engine

    def close_owned(self) -> None:
        if self.owned and self.engine is not None:
            self.engine.close()

    def count(self, request: Request, status: int) -> None:
        if self.engine is not None:
            # the route's template (/v1/models/{model}), never the raw path: a label per path a client
            # makes up would grow the metrics without bound
            route = getattr(request.scope.get("route"), "path", None) or "unmatched"
            self.engine.metrics.requests.labels(route=route, status=str(status)).inc()


def create_app(config: ServeConfig | None = None, *, engine: ServeEngine | None = None,
               tracer_provider: TracerProvider | None = None) -> FastAPI:
    """The ASGI app; pass an engine to share loaded models (tests, embedding), or a config to build one at start.
    `tracer_provider`: where the request spans go (default: OpenTelemetry's global provider)."""
    config = engine.config if engine is not None else (config or ServeConfig())
    api_key = config.api_key()
    slot = _EngineSlot(config, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await slot.get()
        yield
        slot.close_owned()

    app = FastAPI(title="orchestra", version="1", lifespan=lifespan,
                  description="OpenAI-compatible chat completions over a model family whose prefix cache spans "
                              "every member: a prompt cached on one member is mapped into the others.")

    if api_key is not None:
        app.add_middleware(_ApiKey, key=api_key)
    _add_error_handlers(app, slot)
    _add_probe_routes(app, slot)
    _add_api_routes(app, slot)
    add_ui(app, slot.get, auth=api_key is not None)  # the web view at /ui (docs/web-view.md)
    return _wrap(app, config, tracer_provider)


def _add_error_handlers(app: FastAPI, slot: _EngineSlot) -> None:
    """OpenAI-shaped error bodies for every failure, each counted in the request metrics."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        slot.count(request, exc.status)
        return _error_response(exc)

    @app.exception_handler(ExecutorError)
    async def executor_failed(request: Request, exc: ExecutorError) -> JSONResponse:
        # a dead actor while the prompt's cache was built (during decoding it arrives as ExecutorFailed)
        slot.count(request, ExecutorFailed.status)
        code = "actor_lost" if isinstance(exc, ActorLostError) else None
        return _error_response(ExecutorFailed(str(exc), code=code))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        slot.count(request, 400)
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        slot.count(request, exc.status_code)
        kind = "not_found" if exc.status_code == 404 else "invalid_request"
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {exc.detail}",
                                       "type": "invalid_request_error", "param": None, "code": kind}},
                            status_code=exc.status_code, headers=exc.headers)  # e.g. Allow on a 405

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        get_logger("orchestra.serve").exception("internal_error", path=request.url.path)
        slot.count(request, 500)
        return JSONResponse({"error": {"message": f"internal error ({type(exc).__name__}); the server keeps serving",
                                       "type": "server_error", "param": None, "code": "internal_error"}},
                            status_code=500)


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    """The request's first validation error as a 400 naming the parameter."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = first.get("msg", "invalid request")
    kind = first.get("type")
    if kind == "json_invalid":  # its loc is the byte offset of the mistake, not a parameter
        message = "the request body is not valid JSON; send a JSON object"
        loc = []
    elif kind == "extra_forbidden" and len(loc) == 1:
        message = (f"{loc[0]}: this server does not support the parameter {loc[0]!r} (it would change the reply, "
                   "and is not ignored silently); remove it. The parameters it takes are listed in its docs "
                   "(docs/serving.md, Request fields)")
    elif loc:
        message = f"{'.'.join(loc)}: {message}"
        allowed = allowed_range(".".join(loc)) if kind in _RANGE_ERRORS else None
        if allowed:
            message += f" (allowed: {allowed})"
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": ".".join(loc) or None, "code": "invalid_request"}}, status_code=400)


def _add_probe_routes(app: FastAPI, slot: _EngineSlot) -> None:
    """Liveness, readiness and Prometheus metrics: outside the schema and the API key."""

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        await slot.get()
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest((await slot.get()).metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_api_routes(app: FastAPI, slot: _EngineSlot) -> None:
    """The OpenAI-compatible routes, and the cache prefill."""

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=(await slot.get()).model_cards())

    @app.get("/v1/models/{model}", response_model=ModelCard, responses=ERRORS)
    async def get_model(model: str) -> ModelCard:
        engine = await slot.get()
        member = engine.resolve(model)
        return next(card for card in engine.model_cards() if card.id == member)

    @app.post("/v1/cache/prefill", response_model=PrefillResponse, responses=ERRORS)
    async def prefill(body: PrefillRequest, request: Request) -> PrefillResponse:
        member, tokens, lease = await (await slot.get()).prefill(body.model, body.messages)
        slot.count(request, 200)
        return PrefillResponse(model=member, tokens=tokens, path=lease.path, cached_tokens=lease.reused_tokens,
                               seconds=lease.seconds)

    @app.post("/v1/runs", response_model=RunStatus, status_code=201, responses=ERRORS)
    async def start_run(body: RunRequest, request: Request) -> RunStatus:
        """Start a pipeline run on the server's family and caches; follow it at /v1/runs/{id}/events."""
        status = (await slot.get()).runs.start(body)
        slot.count(request, 201)
        return status

    # one route for both methods, so a 405 on it lists both in `Allow`
    @app.api_route("/v1/runs/{run_id}", methods=["GET", "DELETE"], response_model=RunStatus, responses=ERRORS)
    async def run_status(run_id: str, request: Request) -> RunStatus:
        """GET: the run's state and, once it ended, its report. DELETE: cancel it (409 when it already ended)."""
        runs = (await slot.get()).runs
        if request.method == "DELETE":
            return await runs.cancel(run_id)
        return runs.get(run_id)

    @app.get("/v1/runs/{run_id}/events", responses={**ERRORS, 200: {"description": "Server-Sent Events: `event: "
                                                                     "<kind>` and `data: <the typed event as JSON>` "
                                                                     "from the run's start, then `event: end`."}})
    async def run_events(run_id: str) -> StreamingResponse:
        runs = (await slot.get()).runs
        runs.get(run_id)  # 404 before the stream starts
        return StreamingResponse(runs.events(run_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses={**ERRORS, 200: STREAMED})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        engine = await slot.get()
        opened = engine.open(body)
        gen = await opened.__aenter__()  # closed by the response (streamed) or below
        if body.stream:
            return _stream(request, opened, gen, slot)
        return await _complete(request, body, opened, gen, slot)


async def _complete(request: Request, body: ChatCompletionRequest, opened: AbstractAsyncContextManager[Generation],
                    gen: Generation,
                    slot: _EngineSlot) -> Response:
    """The whole completion as one chat.completion; a client that hangs up cancels the generation."""
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_disconnect, request, gen)
            text = await gen.text()
            tg.cancel_scope.cancel()
    except BaseException as exc:
        await opened.__aexit__(type(exc), exc, exc.__traceback__)
        inner = _sole(exc)
        if inner is exc:
            raise
        # the task group wraps the generation's own error (a timeout, a dead actor): answer that one
        raise inner from inner.__cause__
    await opened.__aexit__(None, None, None)
    slot.count(request, 200)
    message, finish = AssistantMessage(content=text), gen.finish_reason
    if gen.request.tool_mode():
        reply = read_tool_reply(text)
        message = AssistantMessage(content=reply.content, tool_calls=reply.calls or None)
        finish = reply.finish_reason or finish
    logprobs = ChoiceLogprobs(content=gen.logprob_content(gen.token_logprobs)) if body.logprobs else None
    completion = ChatCompletion(
        id=gen.id, created=gen.created, model=body.model, usage=gen.usage(),
        choices=[Choice(message=message, finish_reason=finish, logprobs=logprobs)])
    return JSONResponse(completion.model_dump(mode="json"), headers=gen.cache_info.headers())


def _stream(request: Request, opened: AbstractAsyncContextManager[Generation], gen: Generation,
            slot: _EngineSlot) -> StreamingResponse:
    """The completion as Server-Sent Events; the generation closes when the stream ends or the client leaves."""
    include_usage = _wants_usage(gen)
    closed = [False]

    async def close(exc: BaseException | None = None) -> None:
        if not closed[0]:
            closed[0] = True
            with anyio.CancelScope(shield=True):
                await opened.__aexit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)

    def chunk(delta: Delta, finish: str | None = None, usage: Usage | None = None, choices: bool = True,
              logprobs: ChoiceLogprobs | None = None) -> str:
        data = ChatCompletionChunk(id=gen.id, created=gen.created, model=gen.request.model,
                                   choices=[ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)]
                                   if choices else [], usage=usage)
        return f"data: {data.model_dump_json(exclude_none=False)}\n\n"

    async def events() -> AsyncIterator[str]:
        try:
            yield chunk(Delta(role="assistant", content=""))
            if gen.request.tool_mode():  # a call is known only when its JSON is complete: sent whole, once
                reply = read_tool_reply("".join([text async for text in gen.stream()]))
                if reply.calls:
                    yield chunk(Delta(tool_calls=[ToolCallDelta(index=i, id=c.id, type="function", function=c.function)
                                                  for i, c in enumerate(reply.calls)]))
                elif reply.content:
                    yield chunk(Delta(content=reply.content))
                yield chunk(Delta(), finish=reply.finish_reason or gen.finish_reason)
            elif gen.request.logprobs:  # each piece with its tokens' log-probabilities
                async for piece in gen.pieces():
                    yield chunk(Delta(content=piece.text),
                                logprobs=ChoiceLogprobs(content=gen.logprob_content(piece.logprobs)))
                yield chunk(Delta(), finish=gen.finish_reason)
            else:
                async for text in gen.stream():
                    yield chunk(Delta(content=text))
                yield chunk(Delta(), finish=gen.finish_reason)
            if include_usage:
                yield chunk(Delta(), usage=gen.usage(), choices=False)
            slot.count(request, 200)
        except ApiError as exc:  # e.g. the timeout: the stream has started, so it is told in-band
            yield f"data: {json.dumps(exc.body())}\n\n"
        finally:
            await close()
        yield "data: [DONE]\n\n"

    return _ClosingStream(events(), on_end=close, media_type="text/event-stream",
                          headers={"cache-control": "no-cache", **gen.cache_info.headers()})


def _wants_usage(gen: Generation) -> bool:
    options = gen.request.stream_options
    return bool(options and options.include_usage)


def _wrap(app: FastAPI, config: ServeConfig, tracer_provider: TracerProvider | None = None) -> FastAPI:
    app.add_middleware(_BodyLimit, limit=config.max_body_bytes)
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        # outside the key check: a browser's preflight (OPTIONS) carries no Authorization header
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["authorization", "content-type", "x-request-id"],
                           expose_headers=["x-request-id", "retry-after"], max_age=600)
    app.add_middleware(_AccessLog)
    _instrument(app, tracer_provider)
    return app


def _instrument(app: FastAPI, tracer_provider: TracerProvider | None) -> None:
    """A server span per HTTP request (OpenTelemetry's FastAPI instrumentation, the ``tracing`` extra), parent of
    the spans of the pipeline runs it starts; spans go to the global tracer provider, a no-op until one is set
    (``OTEL_EXPORTER_OTLP_ENDPOINT``: `orchestra.observability.tracing.configure_from_env`). Without the package: nothing."""
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError:
        return
    # /metrics and the probes are scraped every few seconds: spans of them would drown the requests
    FastAPIInstrumentor.instrument_app(app, tracer_provider=tracer_provider, excluded_urls="metrics,healthz,readyz")


def _local_path(request: Request) -> str:
    """The path inside this app, also when it is mounted under a prefix in another one."""
    path, root = request.url.path, request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _sole(exc: BaseException) -> BaseException:
    """The one error inside (nested) single-member exception groups, else `exc` itself."""
    while isinstance(getattr(exc, "exceptions", None), tuple) and len(exc.exceptions) == 1:  # type: ignore[attr-defined]
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc


async def _watch_disconnect(request: Request, gen: Generation) -> None:
    """Stop a non-streamed generation as soon as its client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gen.cancel.set()
            return
