"""`orchestra serve --engine vllm`: the family's OpenAI API in front of one vLLM engine per member.

Each member's requests go to its own vLLM server (`orchestra.vllm.VllmEngines`), all of them sharing the
family's store through the connector, so a document computed on one member is loaded, mapped, by the
others. The front keeps orchestra's face: one address for the whole family, members by name or role, the
API key, and ``x-orchestra-*`` headers saying which cache each request's prompt came from (read from the
connector's events by the request id it gives vLLM).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

# FastAPI reads the routes' annotations at run time: Request must be a module name, not a TYPE_CHECKING one
from fastapi import FastAPI, Request
from starlette.responses import Response

if TYPE_CHECKING:
    from orchestra.vllm.engines import VllmEngines

__all__ = ["create_vllm_app"]

_PROXIED = ("/v1/chat/completions", "/v1/completions")


def _error(status: int, message: str, kind: str, code: str) -> Response:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def create_vllm_app(engines: VllmEngines, *, api_key: str | None = None) -> FastAPI:
    """An ASGI app routing each OpenAI request to the vLLM engine of the member it names."""
    import httpx
    from fastapi import FastAPI

    app = FastAPI(title="orchestra (vLLM engines)")
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0))

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Response:
        if api_key and request.url.path.startswith("/v1/") and \
                request.headers.get("authorization", "") != f"Bearer {api_key}":
            return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                          "authentication_error", "invalid_api_key")
        response: Response = await call_next(request)
        return response

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "orchestra"}
                                           for m in engines.served]}

    async def proxy(request: Request) -> Response:
        return await _forward(request, engines, client)

    for path in _PROXIED:
        app.add_api_route(path, proxy, methods=["POST"])

    @app.on_event("shutdown")
    async def close() -> None:
        await client.aclose()

    return app


async def _forward(request: Request, engines: VllmEngines, client: Any) -> Response:
    from fastapi.responses import StreamingResponse
    from starlette.responses import Response as PlainResponse

    try:
        body = json.loads(await request.body())
    except ValueError:
        return _error(400, "the body is not JSON", "invalid_request_error", "invalid_json")
    requested = str(body.get("model", ""))
    member, name = engines.resolve(requested), engines.model_name(requested)
    if member is None or name is None:
        return _error(404, f"model {body.get('model')!r} is not served: use one of {', '.join(engines.served)}",
                      "invalid_request_error", "model_not_found")
    body["model"] = name
    request_id = uuid.uuid4().hex
    upstream = client.build_request("POST", engines.url(member) + request.url.path, json=body,
                                    headers={"X-Request-Id": request_id})
    reply = await client.send(upstream, stream=True)
    chunks = reply.aiter_raw()
    first = b""
    async for chunk in chunks:  # the prompt is computed (or loaded) before vLLM answers a byte
        first = chunk
        break
    headers = _cache_headers(engines, name, request_id)
    if not body.get("stream"):
        rest = [first] + [chunk async for chunk in chunks]
        await reply.aclose()
        return PlainResponse(b"".join(rest), status_code=reply.status_code, headers=headers,
                             media_type=reply.headers.get("content-type"))

    async def stream() -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        finally:
            await reply.aclose()

    return StreamingResponse(stream(), status_code=reply.status_code, headers=headers,
                             media_type=reply.headers.get("content-type"))


def _cache_headers(engines: VllmEngines, member: str, request_id: str) -> dict[str, str]:
    report = engines.cache_report(request_id)
    headers = {"x-orchestra-engine": "vllm", "x-orchestra-member": member, "x-orchestra-cache": report.path,
               "x-orchestra-cached-tokens": str(report.tokens)}
    if report.source:
        headers["x-orchestra-cache-source"] = report.source
    if report.gates:
        headers["x-orchestra-gates"] = ",".join(report.gates)
    return headers
