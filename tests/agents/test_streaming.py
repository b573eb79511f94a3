"""The async wrappers: token streaming from a worker thread, callbacks, cancellation, errors."""

from __future__ import annotations

import anyio
import pytest

from agents import (
    AgentSpec,
    DocumentPrompt,
    GenerationCancelledError,
    GenerationSettings,
    UnknownUpstreamError,
    generate,
    prefill_document,
    run_agent,
    stream_agent,
)
from tests.agents.conftest import DOCUMENT


def _spec(name: str = "writer", n: int = 10) -> AgentSpec:
    return AgentSpec(name=name, task=f"Continue ({name}): the committee",
                     generation=GenerationSettings(max_new_tokens=n))


@pytest.fixture(scope="module")
def prefix(llama_tiny):
    ids = DocumentPrompt(DOCUMENT).token_ids(llama_tiny.tokenizer)
    return ids, prefill_document(llama_tiny.model, ids)


class ForwardCounter:
    def __init__(self, model) -> None:
        self.calls = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


async def test_stream_yields_the_tokens_of_the_result(llama_tiny, prefix):
    ids, prefill = prefix
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    async with stream_agent(model, tok, _spec(), prefix_ids=ids, prefix_cache=prefill.cache) as stream:
        events = [event async for event in stream]
    result = stream.result
    assert [e.token_id for e in events] == result.token_ids
    assert "".join(e.text for e in events) == result.text
    sync = generate(model, tok, _spec(), prefix_ids=ids, prefix_cache=prefill.cache)
    assert sync.token_ids == result.token_ids


async def test_run_agent_with_async_callback_and_concurrent_agents(llama_tiny, prefix):
    ids, prefill = prefix
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    seen: dict[str, list[int]] = {"a": [], "b": []}

    async def on_token(event):
        seen[event.agent].append(event.token_id)
        await anyio.sleep(0)

    results = {}
    limiter = anyio.CapacityLimiter(2)

    async def one(name):
        results[name] = await run_agent(model, tok, _spec(name), prefix_ids=ids, prefix_cache=prefill.cache,
                                        on_token=on_token, limiter=limiter)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "a")
        tg.start_soon(one, "b")
    for name in ("a", "b"):
        assert seen[name] == results[name].token_ids
        alone = generate(model, tok, _spec(name), prefix_ids=ids, prefix_cache=prefill.cache)
        assert alone.token_ids == results[name].token_ids  # sharing the cache concurrently is safe


async def test_cancelling_the_scope_stops_decoding_between_tokens(llama_tiny, prefix):
    ids, prefill = prefix
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    counter = ForwardCounter(model)
    received = []
    try:
        with anyio.CancelScope() as scope:
            async with stream_agent(model, tok, _spec(n=150), prefix_ids=ids, prefix_cache=prefill.cache) as stream:
                async for event in stream:
                    received.append(event)
                    if len(received) == 3:
                        scope.cancel()
        calls_at_exit = counter.calls
        await anyio.sleep(0.3)
        assert counter.calls == calls_at_exit  # the worker thread was joined: no compute after exit
        assert scope.cancelled_caught and len(received) == 3
        assert calls_at_exit < 12  # 1 suffix prefill + a few tokens, far from 200
        with pytest.raises(GenerationCancelledError):
            _ = stream.result
    finally:
        counter.handle.remove()


async def test_fail_after_times_out_an_agent(llama_tiny, prefix):
    ids, prefill = prefix
    model, tok = llama_tiny.model, llama_tiny.tokenizer

    async def slow(_event):
        await anyio.sleep(0.05)

    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.3):
            await run_agent(model, tok, _spec(n=150), prefix_ids=ids, prefix_cache=prefill.cache, on_token=slow)


async def test_leaving_the_block_early_cancels(llama_tiny, prefix):
    ids, prefill = prefix
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    async with stream_agent(model, tok, _spec(n=150), prefix_ids=ids, prefix_cache=prefill.cache) as stream:
        async for _event in stream:
            break
    assert stream.done
    with pytest.raises(GenerationCancelledError) as info:
        _ = stream.result
    assert info.value.tokens_generated < 150


async def test_agent_errors_surface_unwrapped(llama_tiny, prefix):
    ids, prefill = prefix
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    spec = AgentSpec(name="critic", task="Check {summary}")
    with pytest.raises(UnknownUpstreamError):
        await run_agent(model, tok, spec, prefix_ids=ids, prefix_cache=prefill.cache)
    async with stream_agent(model, tok, spec, prefix_ids=ids, prefix_cache=prefill.cache) as stream:
        with pytest.raises(UnknownUpstreamError):
            await stream.wait()


async def test_an_agent_still_queued_on_the_limiter_never_starts(llama_tiny, prefix):
    ids, prefill = prefix
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    limiter = anyio.CapacityLimiter(1)
    counter = ForwardCounter(model)
    try:
        async with limiter:  # the device is busy
            async with stream_agent(model, tok, _spec(), prefix_ids=ids, prefix_cache=prefill.cache,
                                    limiter=limiter) as stream:
                await anyio.sleep(0.05)
        await anyio.sleep(0.1)
        assert counter.calls == 0 and stream.done
        with pytest.raises(GenerationCancelledError):
            _ = stream.result
    finally:
        counter.handle.remove()
