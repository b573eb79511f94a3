"""Async wrappers: run `generate` in a worker thread and stream its tokens through an anyio stream.

``async with stream_agent(...) as stream: async for event in stream: ...`` yields `TokenEvent`s while
the model decodes in a worker thread; ``stream.result`` is the `AgentResult` afterwards. `run_agent`
is the same with an optional (sync or async) per-token callback. Cancelling the surrounding scope
(e.g. ``anyio.fail_after``) or leaving the block early stops decoding at the next token boundary; the
worker thread is always joined before the block exits, so no compute outlives its caller.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager
from typing import TYPE_CHECKING

import anyio

from agents.bridge import ThreadStream, WorkerCancelledError
from agents.errors import GenerationCancelledError
from agents.runner import AgentResult, TokenEvent, generate
from agents.spec import AgentSpec

if TYPE_CHECKING:
    from agents.remote import ReplyDecoder
    from mappings.types import CacheLike, Model, Tokenizer

__all__ = ["AgentStream", "stream_agent", "run_agent", "run_decoded"]


class AgentStream:
    """Async iterator over one agent's TokenEvents; `result` once the stream is exhausted."""

    def __init__(self, agent: str, stream: ThreadStream[TokenEvent, AgentResult]) -> None:
        self.agent = agent
        self._stream = stream

    def __aiter__(self) -> AgentStream:
        return self

    async def __anext__(self) -> TokenEvent:
        return await self._stream.__anext__()  # the agent's error, unwrapped, once its tokens are out

    async def wait(self) -> AgentResult:
        """Drain the remaining events and return the result (raises the agent's error, if any)."""
        async for _ in self:
            pass
        return self.result

    @property
    def done(self) -> bool:
        return self._stream.done

    @property
    def result(self) -> AgentResult:
        if not self._stream.done:
            raise RuntimeError(f"agent {self.agent!r} has not finished; iterate the stream to the end first")
        try:
            return self._stream.result_nowait()
        except WorkerCancelledError:  # left while it was still queued (e.g. on the limiter): no token made
            raise GenerationCancelledError(self.agent, 0) from None


@asynccontextmanager
async def stream_agent(
    model: Model,
    tokenizer: Tokenizer,
    spec: AgentSpec,
    *,
    prefix_ids: Sequence[int],
    prefix_cache: CacheLike | None = None,
    upstream: Mapping[str, object] | None = None,
    limiter: anyio.CapacityLimiter | None = None,
    use_chat_template: bool | None = None,
    lock: AbstractContextManager[object] | None = None,
) -> AsyncIterator[AgentStream]:
    """Run `generate` in a worker thread (bounded by ``limiter``, e.g. one per device), streaming tokens.

    Arguments are those of `agents.runner.generate`. Errors of the agent (AgentError and others) are
    raised from the iteration / ``result``, unwrapped.
    """

    def work(emit: Callable[[TokenEvent], None], cancel: threading.Event) -> AgentResult:  # the worker thread
        return generate(model, tokenizer, spec, prefix_ids=prefix_ids, prefix_cache=prefix_cache, upstream=upstream,
                        on_token=emit, cancel=cancel, use_chat_template=use_chat_template, lock=lock)

    async with _worker_stream(spec.name, work, limiter) as stream:
        yield stream


@asynccontextmanager
async def _worker_stream(agent: str, work: Callable[[Callable[[TokenEvent], None], threading.Event], AgentResult],
                         limiter: anyio.CapacityLimiter | None) -> AsyncIterator[AgentStream]:
    # Leaving the block early or being cancelled stops decoding at the next token and joins the thread
    # (one still queued on the limiter never starts); the caller's own errors leave the block unwrapped.
    async with ThreadStream(work, limiter=limiter) as stream:
        yield AgentStream(agent, stream)


async def run_decoded(decoder: ReplyDecoder, tokenizer: Tokenizer, spec: AgentSpec, *, prefix_ids: Sequence[int],
                      upstream: Mapping[str, object] | None = None,
                      on_token: Callable[[TokenEvent], Awaitable[None] | None] | None = None,
                      limiter: anyio.CapacityLimiter | None = None, limit: int | None = None) -> AgentResult:
    """`run_agent` with the replies decoded by ``decoder`` (an engine, `agents.remote.generate_with`)."""
    from agents.remote import generate_with

    def work(emit: Callable[[TokenEvent], None], cancel: threading.Event) -> AgentResult:  # the worker thread
        return generate_with(decoder, tokenizer, spec, prefix_ids=prefix_ids, upstream=upstream, on_token=emit,
                             cancel=cancel, limit=limit)

    async with _worker_stream(spec.name, work, limiter) as stream:
        return await _drain(stream, on_token)


async def _drain(stream: AgentStream, on_token: Callable[[TokenEvent], Awaitable[None] | None] | None) -> AgentResult:
    async for event in stream:
        if on_token is not None:
            maybe = on_token(event)
            if inspect.isawaitable(maybe):
                await maybe
    return stream.result


async def run_agent(
    model: Model,
    tokenizer: Tokenizer,
    spec: AgentSpec,
    *,
    prefix_ids: Sequence[int],
    prefix_cache: CacheLike | None = None,
    upstream: Mapping[str, object] | None = None,
    on_token: Callable[[TokenEvent], Awaitable[None] | None] | None = None,
    limiter: anyio.CapacityLimiter | None = None,
    use_chat_template: bool | None = None,
    lock: AbstractContextManager[object] | None = None,
) -> AgentResult:
    """Run one agent without blocking the event loop; ``on_token`` (sync or async) sees every token."""
    async with stream_agent(model, tokenizer, spec, prefix_ids=prefix_ids, prefix_cache=prefix_cache,
                            upstream=upstream, limiter=limiter, use_chat_template=use_chat_template,
                            lock=lock) as stream:
        return await _drain(stream, on_token)

