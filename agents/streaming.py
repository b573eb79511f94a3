"""Async wrappers: run `generate` in a worker thread and stream its tokens through an anyio stream.

``async with stream_agent(...) as stream: async for event in stream: ...`` yields `TokenEvent`s while
the model decodes in a worker thread; ``stream.result`` is the `AgentResult` afterwards. `run_agent`
is the same with an optional (sync or async) per-token callback. Cancelling the surrounding scope
(e.g. ``anyio.fail_after``) or leaving the block early stops decoding at the next token boundary; the
worker thread is always joined before the block exits, so no compute outlives its caller.
"""

from __future__ import annotations

import inspect
import math
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
from anyio import from_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agents.errors import GenerationCancelledError
from agents.runner import AgentResult, TokenEvent, generate
from agents.spec import AgentSpec

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["AgentStream", "stream_agent", "run_agent"]


class AgentStream:
    """Async iterator over one agent's TokenEvents; `result` once the stream is exhausted."""

    def __init__(self, agent: str, receive: MemoryObjectReceiveStream[TokenEvent]) -> None:
        self.agent = agent
        self._receive = receive
        self._result: AgentResult | None = None
        self._error: BaseException | None = None
        self._done = False

    def __aiter__(self) -> AgentStream:
        return self

    async def __anext__(self) -> TokenEvent:
        try:
            return await self._receive.receive()
        except anyio.EndOfStream:
            if self._error is not None:
                raise self._error from None
            raise StopAsyncIteration from None

    async def wait(self) -> AgentResult:
        """Drain the remaining events and return the result (raises the agent's error, if any)."""
        async for _ in self:
            pass
        return self.result

    @property
    def done(self) -> bool:
        return self._done

    @property
    def result(self) -> AgentResult:
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError(f"agent {self.agent!r} has not finished; iterate the stream to the end first")
        return self._result


@asynccontextmanager
async def stream_agent(
    model: Any,
    tokenizer: Any,
    spec: AgentSpec,
    *,
    prefix_ids: Sequence[int],
    prefix_cache: Any | None = None,
    upstream: Mapping[str, Any] | None = None,
    limiter: anyio.CapacityLimiter | None = None,
    use_chat_template: bool | None = None,
    lock: Any = None,
) -> AsyncIterator[AgentStream]:
    """Run `generate` in a worker thread (bounded by ``limiter``, e.g. one per device), streaming tokens.

    Arguments are those of `agents.runner.generate`. Errors of the agent (AgentError and others) are
    raised from the iteration / ``result``, unwrapped.
    """
    cancel = threading.Event()
    send: MemoryObjectSendStream[TokenEvent]
    send, receive = anyio.create_memory_object_stream[TokenEvent](max_buffer_size=math.inf)
    stream = AgentStream(spec.name, receive)

    emitted = [0]

    def emit(event: TokenEvent) -> None:  # runs in the worker thread
        emitted[0] += 1
        try:
            from_thread.run_sync(send.send_nowait, event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            cancel.set()  # nobody is listening any more

    async def worker() -> None:
        async with send:
            try:
                stream._result = await anyio.to_thread.run_sync(
                    partial(generate, model, tokenizer, spec, prefix_ids=prefix_ids, prefix_cache=prefix_cache,
                            upstream=upstream, on_token=emit, cancel=cancel,
                            use_chat_template=use_chat_template, lock=lock),
                    limiter=limiter,
                )
            except Exception as exc:  # handed to the consumer unwrapped, not as an ExceptionGroup
                stream._error = exc
            finally:
                if stream._result is None and stream._error is None:  # cancelled before the thread ran
                    stream._error = GenerationCancelledError(spec.name, emitted[0])
                stream._done = True

    try:
        async with receive, anyio.create_task_group() as tg:
            tg.start_soon(worker)
            try:
                yield stream
            finally:
                if not stream.done:
                    # The consumer left early or was cancelled: stop at the next token (a running thread is
                    # still waited for; one still queued on the limiter never starts).
                    cancel.set()
                    tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The worker never raises, so the group holds what the caller's own block raised: re-raise it as is.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def run_agent(
    model: Any,
    tokenizer: Any,
    spec: AgentSpec,
    *,
    prefix_ids: Sequence[int],
    prefix_cache: Any | None = None,
    upstream: Mapping[str, Any] | None = None,
    on_token: Callable[[TokenEvent], Awaitable[None] | None] | None = None,
    limiter: anyio.CapacityLimiter | None = None,
    use_chat_template: bool | None = None,
    lock: Any = None,
) -> AgentResult:
    """Run one agent without blocking the event loop; ``on_token`` (sync or async) sees every token."""
    async with stream_agent(model, tokenizer, spec, prefix_ids=prefix_ids, prefix_cache=prefix_cache,
                            upstream=upstream, limiter=limiter, use_chat_template=use_chat_template,
                            lock=lock) as stream:
        async for event in stream:
            if on_token is not None:
                maybe = on_token(event)
                if inspect.isawaitable(maybe):
                    await maybe
        return stream.result

