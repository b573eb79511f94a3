"""A tool that overruns its timeout: the agent gets the timeout error, and no thread of the tool is abandoned.

An async tool is cancelled at the deadline and its thread joined before `run_tool` returns; a sync tool (which
Python cannot interrupt) runs on with its result discarded, in a thread the run's `ToolWorkers` joins.
"""

from __future__ import annotations

import threading
import time

import anyio

from agents.tools import OVERRUN_TOOLS, ToolWorkers, run_tool, tool

DOC = "Grant of Copyright License.\n\nTrademarks. This License does not grant."


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


def test_an_async_tool_that_overruns_is_cancelled_and_its_thread_joined_before_run_tool_returns():
    after_sleep: list[str] = []
    cancelled = threading.Event()

    @tool(timeout_s=0.2)
    async def dawdle(seconds: float) -> str:
        """Sleeps, then notes that it woke."""
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise
        after_sleep.append("woke")
        return "woke"

    before = set(threading.enumerate())
    workers = ToolWorkers()
    call = run_tool([dawdle], "dawdle", {"seconds": 0.6}, document=DOC, round=0, workers=workers)
    assert not call.ok and call.result == "error: dawdle did not answer within 0.2 s"
    assert cancelled.is_set()  # its cancel scope was cancelled at the deadline
    assert _new_threads(before) == [] and workers.alive() == []  # its thread was joined, none handed on
    time.sleep(1.0)  # past the end of the sleep it was cancelled in: nothing of it runs on
    assert after_sleep == []
    assert not any(t.name == "tool-dawdle" for t in threading.enumerate())


def test_an_async_tool_that_answers_in_time_or_fails_is_read_as_a_sync_one_is():
    @tool(timeout_s=5)
    async def echo(text: str, document: str) -> dict[str, object]:
        """Echoes the text with the document's length."""
        await anyio.sleep(0)
        return {"text": text, "chars": len(document)}

    @tool
    async def offline(x: int) -> str:
        """Always fails."""
        raise RuntimeError("the index is offline")

    ok = run_tool([echo], "echo", {"text": "hi"}, document=DOC, round=2)
    assert ok.ok and ok.result == f'{{"text": "hi", "chars": {len(DOC)}}}' and ok.round == 2
    failed = run_tool([offline], "offline", {"x": 1}, document=DOC, round=0)
    assert not failed.ok and failed.result == "error: RuntimeError: the index is offline"


def test_an_async_tool_that_shields_itself_from_cancellation_is_tracked_like_a_sync_one():
    release = threading.Event()
    finished: list[str] = []

    @tool(timeout_s=0.2)
    async def stubborn(x: int) -> str:
        """Ignores cancellation until released."""
        with anyio.CancelScope(shield=True):
            while not release.is_set():
                await anyio.sleep(0.01)
        finished.append("done")
        return "late"

    with ToolWorkers() as workers:
        call = run_tool([stubborn], "stubborn", {"x": 1}, document=DOC, round=0, workers=workers)
        assert not call.ok and call.result == "error: stubborn did not answer within 0.2 s"
        [thread] = workers.alive()
        assert thread.name == "tool-stubborn"
        release.set()
    assert not thread.is_alive() and finished == ["done"]


def test_a_sync_tool_that_overruns_gets_the_timeout_error_and_its_thread_is_joined_when_the_run_ends():
    release = threading.Event()
    finished: list[int] = []

    @tool(timeout_s=0.2)
    def stuck(x: int) -> str:
        """Waits to be released."""
        release.wait()
        finished.append(x)
        return "late"

    before = set(threading.enumerate())
    with ToolWorkers() as workers:
        call = run_tool([stuck], "stuck", {"x": 7}, document=DOC, round=0, workers=workers)
        assert not call.ok and call.result == "error: stuck did not answer within 0.2 s"
        [thread] = workers.alive()  # it runs on (Python cannot interrupt it), tracked by the run
        assert thread.name == "tool-stuck" and finished == []
        assert workers.join(timeout=0.05) is False  # still blocked: a bounded join says so
        release.set()
    # leaving the block joined it: it ran to its end, and its result went nowhere
    assert not thread.is_alive() and finished == [7]
    assert workers.alive() == [] and _new_threads(before) == []


def test_without_workers_an_overrunning_sync_tool_is_tracked_by_the_module():
    release = threading.Event()

    @tool(timeout_s=0.2)
    def stuck_too(x: int) -> str:
        """Waits to be released."""
        release.wait()
        return "late"

    call = run_tool([stuck_too], "stuck_too", {"x": 1}, document=DOC, round=0)
    assert not call.ok and call.result == "error: stuck_too did not answer within 0.2 s"
    [thread] = [t for t in OVERRUN_TOOLS.alive() if t.name == "tool-stuck_too"]
    release.set()
    thread.join()
    assert thread not in OVERRUN_TOOLS.alive()


def test_an_agents_tool_rounds_end_only_after_an_overrunning_sync_tool_has():
    """The agent's run does not return while a tool it gave up on still runs: nothing of it outlives the run."""
    from agents.runner import _Generation, _tool_rounds
    from agents.spec import AgentSpec

    release, finished = threading.Event(), []

    @tool(timeout_s=0.1)
    def lookup(text: str) -> str:
        """Looks the text up, slowly."""
        release.wait(30)
        time.sleep(0.2)  # still working after it was let go: an unjoined run would be gone by now
        finished.append(text)
        return text

    spec = AgentSpec(name="a", task="Answer.", tools=[lookup])
    replies = iter(['{"tool": "lookup", "arguments": {"text": "copyleft"}}', '{"answer": "done"}'])

    def attempt(index, round_spec, turns):
        if index == 1:  # the call timed out (its error is the turn before this round): let the tool go on
            assert "did not answer within" in turns[-1].instruction and not finished
            release.set()
        return _Generation(next(replies), "stop")

    generation, calls = _tool_rounds(spec, attempt, DOC)
    assert generation.text == "done" and not calls[0].ok
    assert finished == ["copyleft"]  # joined: the tool's thread had ended when the rounds returned
