"""The HTTP API (Starlette): documents, sessions, streamed chat messages, model switches.

    uvicorn examples.chat_backend.app:app            # from the repository root
    python -m examples.chat_backend --port 8000      # the same, with command-line settings

Errors are JSON ``{"error": {"type", "message", "status"}}`` with a matching HTTP status; an error in
one request never stops the server or other sessions. The engine (family manifest, registry) is
created on the first request, models load on first use.
"""

from __future__ import annotations

import json
import threading
from typing import Any, TypeVar

import structlog
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from examples.chat_backend.config import ChatConfig
from examples.chat_backend.engine import ChatEngine, bundled_documents
from examples.chat_backend.errors import ApiError, BadRequest, SessionNotFound
from examples.chat_backend.schemas import DocumentIn, DocumentOut, MessageIn, SessionIn, SwitchIn
from examples.chat_backend.sse import EventStreamResponse
from orchestra import OrchestraError

__all__ = ["create_app", "app"]

log = structlog.get_logger("orchestra.chat")
M = TypeVar("M", bound=BaseModel)


class _EngineHolder:
    """Builds the engine on first use, so importing the app (e.g. by uvicorn) reads no files."""

    def __init__(self, config: ChatConfig | None, engine: ChatEngine | None) -> None:
        self._config = config
        self._engine = engine
        self._lock = threading.Lock()

    def get(self) -> ChatEngine:
        with self._lock:
            if self._engine is None:
                try:
                    self._engine = ChatEngine(self._config or ChatConfig.from_env())
                except Exception as exc:  # e.g. the family is not built
                    raise _Unavailable(f"the chat engine cannot start: {type(exc).__name__}: {exc}; build the "
                                       "family with `orchestra family build` and set ORCHESTRA_HOME") from exc
            return self._engine


class _Unavailable(ApiError):
    status, type = 503, "engine_unavailable"


def _error(status: int, type_: str, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"type": type_, "message": message, "status": status, **extra}}, status_code=status)


async def _body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc}); send a JSON object") from exc
    return model.model_validate(data)  # ValidationError -> 422 (handler below)


def create_app(config: ChatConfig | None = None, *, engine: ChatEngine | None = None) -> Starlette:
    """The ASGI app; pass an engine to share loaded models (tests), or a config to build one lazily."""
    holder = _EngineHolder(config, engine)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        return JSONResponse({"models": [m.model_dump() for m in holder.get().models()],
                             "source": holder.get().source})

    async def bundled(request: Request) -> Response:
        return JSONResponse({"bundled": sorted(bundled_documents())})

    async def create_document(request: Request) -> Response:
        eng = holder.get()
        if request.headers.get("content-type", "").startswith("text/plain"):
            body = DocumentIn(text=(await request.body()).decode("utf-8", errors="replace"),
                              name=request.query_params.get("name"))
        else:
            body = await _body(request, DocumentIn)
        doc, reused = await eng.add_document(body)
        out = _document_out(eng, doc, reused)
        return JSONResponse(out.model_dump(mode="json"), status_code=200 if reused else 201)

    async def get_document(request: Request) -> Response:
        eng = holder.get()
        doc = eng.document(request.path_params["document_id"])
        return JSONResponse(_document_out(eng, doc, True).model_dump(mode="json"))

    async def create_session(request: Request) -> Response:
        eng = holder.get()
        body = await _body(request, SessionIn)
        session = eng.create_session(body.document_id, body.model, body.system)
        return JSONResponse(eng.view(session).model_dump(mode="json"), status_code=201)

    async def get_session(request: Request) -> Response:
        eng = holder.get()
        return JSONResponse(eng.view(eng.session(request.path_params["session_id"])).model_dump(mode="json"))

    async def delete_session(request: Request) -> Response:
        holder.get().delete_session(request.path_params["session_id"])
        return Response(status_code=204)

    async def post_message(request: Request) -> Response:
        eng = holder.get()
        session = eng.session(request.path_params["session_id"])  # 404 before any stream starts
        body = await _body(request, MessageIn)
        if body.max_new_tokens is not None and body.max_new_tokens > eng.config.max_new_tokens_limit:
            raise BadRequest(f"max_new_tokens {body.max_new_tokens} is above this server's limit of "
                             f"{eng.config.max_new_tokens_limit}")
        if body.model is not None:
            eng.resolve_model(body.model)  # 422 before any stream starts
        await eng.precheck(session, body)  # 409 when it cannot fit

        async def produce(emit, stop) -> None:
            async with session.lock:  # concurrent messages on one session run one after the other
                try:
                    await eng.turn(session, body, emit, stop)
                except ApiError as exc:
                    await emit("error", exc.body()["error"])
                except Exception as exc:  # reported in the stream; the server and other sessions go on
                    log.exception("turn_failed", session=session.id)
                    await emit("error", {"type": "internal_error", "status": 500,
                                         "message": f"{type(exc).__name__}: {exc}"})

        return EventStreamResponse(produce)

    async def switch(request: Request) -> Response:
        eng = holder.get()
        session = eng.session(request.path_params["session_id"])
        body = await _body(request, SwitchIn)
        alias = eng.resolve_model(body.model)
        events: list[dict[str, Any]] = []

        async def collect(event: str, data: dict[str, Any]) -> None:
            events.append({"event": event, **data})

        async with session.lock:
            if session.deleted:
                raise SessionNotFound(f"session {session.id!r} was deleted")
            await eng.switch(session, alias, collect)
        return JSONResponse({"session": eng.view(session).model_dump(mode="json"), "events": events})

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ValidationError)
        details = [{"field": ".".join(str(p) for p in e["loc"]) or "(body)", "message": e["msg"]}
                   for e in exc.errors()]
        text = "; ".join(f"{d['field']}: {d['message']}" for d in details)
        return _error(422, "invalid_request", f"the request body does not validate: {text}", details=details)

    async def orchestra_error(request: Request, exc: Exception) -> Response:
        # e.g. a model that does not fit on its device: the request fails, the server goes on
        log.error("orchestra_error", error=str(exc), type=type(exc).__name__)
        return _error(500, type(exc).__name__, str(exc))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(exc.status_code, "http_error", str(exc.detail))

    routes = [
        Route("/healthz", health, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/documents", create_document, methods=["POST"]),
        Route("/documents/bundled", bundled, methods=["GET"]),
        Route("/documents/{document_id}", get_document, methods=["GET"]),
        Route("/sessions", create_session, methods=["POST"]),
        Route("/sessions/{session_id}", get_session, methods=["GET"]),
        Route("/sessions/{session_id}", delete_session, methods=["DELETE"]),
        Route("/sessions/{session_id}/messages", post_message, methods=["POST"]),
        Route("/sessions/{session_id}/switch", switch, methods=["POST"]),
    ]
    handlers = {ApiError: api_error, ValidationError: validation_error, HTTPException: http_error,
                OrchestraError: orchestra_error}
    application = Starlette(routes=routes, exception_handlers=handlers)
    application.state.engine_holder = holder
    return application


def _document_out(eng: ChatEngine, doc, reused: bool) -> DocumentOut:
    return DocumentOut(document_id=doc.id, name=doc.name, tokens=len(doc.prefix_ids), source_model=eng.source,
                       prefill_s=doc.lease.prefill_seconds, reused=reused, caches={eng.source: doc.info})


app = create_app()
