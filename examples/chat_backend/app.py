"""A chat backend of your own on FastAPI, with orchestra's engine in the same process.

    python examples/chat_backend/app.py --document contract.txt [--home ~/.cache/orchestra] [--port 8080]
    curl -N localhost:8080/ask -H 'content-type: application/json' -d '{"question": "Who may copy it?"}'

The backend answers questions about one document it was started with:

* ``POST /ask`` (``{"question": ..., "model": "root", "max_tokens": 64}``) is the backend's own route: it
  asks orchestra's `ServeEngine` directly (no HTTP in between) and streams the answer as Server-Sent
  Events: first ``event: cache`` (how the prompt's cache was obtained: ``exact``, ``mapped`` from another
  member, or ``reprefilled``; and how many prompt tokens were not recomputed), then one ``data:
  {"text": ...}`` per piece of the answer, then ``event: done`` (finish reason and token counts);
* ``/llm/...`` is orchestra's OpenAI-compatible app mounted on the same engine, so an OpenAI client
  (``base_url="http://127.0.0.1:8080/llm/v1"``) shares the backend's models and cache.

The document is the system message of every question, so it is prefilled once; every later question,
on any member of the family, starts from that cache (exact on the same member, mapped into another one
when the family has a mapping for the pair). A missing document or family is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from orchestra.serve import ApiError, ChatCompletionRequest, ChatMessage, ServeConfig, ServeEngine, create_app

INSTRUCTION = "Answer questions about this document, briefly."


class Ask(BaseModel):
    """The body of ``POST /ask``."""

    question: str = Field(min_length=1)
    model: str = Field("root", description="A family member, by role or name.")
    max_tokens: int = Field(64, ge=1, le=1024)


def _event(data: Mapping[str, object], event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n"


def create_backend(document: str, config: ServeConfig | None = None) -> FastAPI:
    """The backend's app: its own `/ask` route and orchestra's OpenAI app under `/llm`, over one engine."""
    engine = ServeEngine(config or ServeConfig())  # loads the family's manifest; members load on first use

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.close()  # in-flight replies finish, decoding threads stop

    app = FastAPI(title="chat backend", lifespan=lifespan)
    # orchestra's app, on the same engine (a mounted app runs no lifespan: the engine is made above)
    app.mount("/llm", create_app(engine=engine))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:  # an unknown model, a prompt too long
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.post("/ask")
    async def ask(body: Ask) -> StreamingResponse:
        engine.resolve(body.model)  # an unknown model is a 404 now, before the stream starts
        # the document is the same first message of every question: the prefix each one finds cached
        req = ChatCompletionRequest(model=body.model, max_tokens=body.max_tokens, temperature=0.0, messages=[
            ChatMessage(role="system", content=f"{INSTRUCTION}\n\n{document}"),
            ChatMessage(role="user", content=body.question)])

        async def answer() -> AsyncIterator[str]:
            try:
                async with engine.open(req) as gen:  # admitted, the prompt's cache leased; closed however it ends
                    info = gen.cache_info
                    yield _event({"model": body.model, "path": info.path, "source": info.source,
                                  "cached_tokens": info.cached_tokens}, "cache")
                    async for text in gen.stream():
                        yield _event({"text": text})
                    usage = gen.usage()
                    yield _event({"finish_reason": gen.finish_reason, "prompt_tokens": usage.prompt_tokens,
                                  "completion_tokens": usage.completion_tokens}, "done")
            except ApiError as exc:  # the stream has begun (a full queue, a timeout): said in-band
                yield _event(exc.body(), "error")

        return StreamingResponse(answer(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--document", type=Path, required=True, help="the text file questions are about")
    parser.add_argument("--home", type=Path, help="the family home (default: $ORCHESTRA_HOME or ~/.cache/orchestra)")
    parser.add_argument("--device", default="auto", help="cpu, cuda:N or auto")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    if not args.document.is_file():
        print(f"error: --document {args.document} is not a file", file=sys.stderr)
        return 2

    import uvicorn

    from orchestra import OrchestraError

    try:
        app = create_backend(args.document.read_text(encoding="utf-8"), ServeConfig(home=args.home, device=args.device))
    except OrchestraError as exc:  # no family in the home, a member that changed on disk, ...
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # uvicorn shuts down gracefully on Ctrl+C or SIGTERM, then re-raises the signal to the handler that was
    # there before it: noted here, so that a shutdown that was asked for ends with exit code 0
    received: list[int] = []
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda sig, frame: received.append(sig))
    uvicorn.run(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
