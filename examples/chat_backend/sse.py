"""Server-sent events: an ASGI response that runs a producer and streams what it emits.

Unlike Starlette's StreamingResponse over an async generator, the producer runs inside the
response's own task, so locks and cancel scopes it opens are entered and left by one task, and a
client disconnect is seen while it runs: `stop` is set (the decoding thread checks it between
tokens) and whatever the producer is waiting for (e.g. a busy session's lock) is cancelled.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["EventStreamResponse", "encode_event", "parse_events", "Producer"]

Emit = Callable[[str, dict[str, Any]], Awaitable[None]]
Producer = Callable[[Emit, threading.Event], Awaitable[None]]


def encode_event(event_id: int, event: str, data: dict[str, Any]) -> bytes:
    """One SSE frame; the JSON is compact and on one line, so `data:` never needs splitting."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"id: {event_id}\nevent: {event}\ndata: {payload}\n\n".encode()


def parse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) pairs of an SSE body written by `encode_event` (for clients and tests)."""
    out = []
    for frame in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line)
        if "event" in fields:
            out.append((fields["event"], json.loads(fields.get("data", "{}"))))
    return out


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stop = threading.Event()
        ids = itertools.count()
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def emit(event: str, data: dict[str, Any]) -> None:
            if stop.is_set():
                return
            try:
                await send({"type": "http.response.body", "body": encode_event(next(ids), event, data),
                            "more_body": True})
            except OSError:  # the client went away
                stop.set()

        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        stop.set()
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            try:
                await self.producer(emit, stop)
            finally:
                tg.cancel_scope.cancel()
        if not stop.is_set():
            try:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass
