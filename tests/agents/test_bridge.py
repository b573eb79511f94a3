"""The sync<->async bridge: items in order, errors unwrapped, cancel-and-join on every way out, the sync twin."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import anyio
import anyio.from_thread
import pytest

from agents.bridge import CancelFlag, ThreadStream, WorkerCancelledError, iterate_sync, run_in_thread


class Boom(Exception):
    pass


class Steps:
    """Work that emits 0, 1, 2, ... every `pause` seconds until cancelled or `n` are out; counts its steps."""

    def __init__(self, n: int = 1_000_000, pause: float = 0.005) -> None:
        self.n, self.pause = n, pause
        self.steps = 0
        self.saw_cancel = False
        self.thread: threading.Thread | None = None

    def __call__(self, emit: Callable[[int], None], cancel: threading.Event) -> int:
        self.thread = threading.current_thread()
        for i in range(self.n):
            if cancel.is_set():
                self.saw_cancel = True
                return -1
            self.steps += 1
            emit(i)
            time.sleep(self.pause)
        return self.n


async def test_items_arrive_in_order_then_the_result():
    async with ThreadStream(Steps(n=200, pause=0)) as stream:
        items = [item async for item in stream]
        assert await stream.result() == 200
    assert items == list(range(200))
    assert stream.done and stream.started


async def test_worker_errors_surface_unwrapped_after_the_items_before_them():
    def work(emit: Callable[[str], None], cancel: threading.Event) -> None:
        emit("a")
        emit("b")
        raise Boom("in the worker")

    seen: list[str] = []
    async with ThreadStream(work) as stream:
        with pytest.raises(Boom, match="in the worker"):
            async for item in stream:
                seen.append(item)
        with pytest.raises(Boom):
            await stream.result()
    assert seen == ["a", "b"]
    with pytest.raises(Boom):
        stream.result_nowait()


async def test_leaving_the_block_early_cancels_and_joins_the_worker():
    work = Steps()
    async with ThreadStream(work) as stream:
        async for item in stream:
            if item == 3:
                break
    steps_at_exit = work.steps
    assert work.saw_cancel and stream.done
    assert work.thread is not None
    await anyio.sleep(0.05)
    assert work.steps == steps_at_exit  # joined: no work after the block
    assert await stream.result() == -1  # what the work returned when it saw the cancel


async def test_a_cancelled_scope_cancels_and_joins_the_worker():
    work = Steps()
    with anyio.CancelScope() as scope:
        async with ThreadStream(work) as stream:
            async for item in stream:
                if item == 2:
                    scope.cancel()
    assert scope.cancelled_caught
    steps_at_exit = work.steps
    assert work.saw_cancel and stream.done
    await anyio.sleep(0.05)
    assert work.steps == steps_at_exit


async def test_a_cancelled_scope_gets_no_further_item_even_when_items_are_buffered():
    received = []
    async with ThreadStream(Steps(n=5, pause=0)) as stream:
        await stream.wait()  # the work has ended: all five items wait in the buffer
        with anyio.CancelScope() as scope:
            async for item in stream:
                received.append(item)
                scope.cancel()
    assert scope.cancelled_caught and received == [0]


async def test_a_timeout_waiting_for_the_result_cancels_and_joins_the_worker():
    work = Steps()
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            await run_in_thread(lambda cancel: work(lambda _item: None, cancel))
    steps_at_exit = work.steps
    assert work.saw_cancel
    await anyio.sleep(0.05)
    assert work.steps == steps_at_exit


async def test_the_callers_own_error_leaves_the_block_unwrapped():
    work = Steps()
    with pytest.raises(KeyError):
        async with ThreadStream(work) as stream:
            async for _item in stream:
                raise KeyError("the caller's")
    assert work.saw_cancel and stream.done


async def test_a_worker_that_never_emits_completes():
    async with ThreadStream(lambda emit, cancel: 42) as stream:
        assert [item async for item in stream] == []
        assert await stream.result() == 42
    assert await run_in_thread(lambda cancel: "done") == "done"


async def test_emit_never_blocks_the_worker_on_a_busy_event_loop():
    emitted_all = threading.Event()

    def work(emit: Callable[[int], None], cancel: threading.Event) -> None:
        for i in range(100):
            emit(i)
        emitted_all.set()

    async with ThreadStream(work) as stream:
        await anyio.sleep(0.01)  # let the worker start
        time.sleep(0.3)  # the event loop is busy (blocked): the worker goes on regardless
        assert emitted_all.is_set()
        assert [item async for item in stream] == list(range(100))


async def test_a_job_still_queued_on_the_limiter_never_starts():
    limiter = anyio.CapacityLimiter(1)
    work = Steps()
    async with limiter:  # the device is busy
        async with ThreadStream(work, limiter=limiter) as stream:
            await anyio.sleep(0.05)
    await anyio.sleep(0.05)
    assert stream.done and not stream.started and work.steps == 0
    with pytest.raises(WorkerCancelledError):
        stream.result_nowait()


async def test_a_result_nobody_received_goes_to_discard():
    discarded: list[str] = []
    release = threading.Event()

    def work(cancel: threading.Event) -> str:
        release.wait()  # ignores the cancel: the result is made after the caller gave up
        return "lease"

    with anyio.move_on_after(0.05) as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: anyio.to_thread.run_sync(lambda: (time.sleep(0.1), release.set())))
            await run_in_thread(work, discard=discarded.append)
    assert scope.cancelled_caught
    assert discarded == ["lease"]
    # a delivered result is not discarded
    assert await run_in_thread(lambda cancel: "kept", discard=discarded.append) == "kept"
    assert discarded == ["lease"]


async def test_a_dedicated_thread_runs_the_work_and_is_joined():
    work = Steps(n=5, pause=0)
    async with ThreadStream(work, thread_name="decode-test") as stream:
        assert [item async for item in stream] == list(range(5))
        assert await stream.result() == 5
    assert work.thread is not None and work.thread.name == "decode-test" and not work.thread.is_alive()


async def test_wait_returns_once_the_work_ended_from_another_task():
    work = Steps()
    stream = ThreadStream(work)
    async with anyio.create_task_group() as tg:
        async def consume() -> None:
            async with stream:
                async for _ in stream:
                    await anyio.sleep(1)  # slow consumer, cancelled below

        tg.start_soon(consume)
        await anyio.sleep(0.05)
        stream.cancel.set()  # e.g. a client that went away
        await stream.wait()
        assert work.saw_cancel and stream.done
        tg.cancel_scope.cancel()


async def test_anyio_from_thread_works_in_the_worker():
    def work(emit: Callable[[int], None], cancel: threading.Event) -> int:
        return anyio.from_thread.run_sync(lambda: 7)  # an anyio worker thread: no token needed

    async with ThreadStream(work) as stream:
        assert await stream.result() == 7


# -- the sync twin ---------------------------------------------------------------------------------
def test_run_sync_hands_items_over_and_returns_the_result():
    seen: list[int] = []
    assert ThreadStream.run_sync(Steps(n=10, pause=0), on_item=seen.append) == 10
    assert seen == list(range(10))


def test_run_sync_propagates_the_workers_error():
    def work(emit: Callable[[int], None], cancel: threading.Event) -> int:
        emit(1)
        raise Boom("sync")

    with pytest.raises(Boom, match="sync"):
        ThreadStream.run_sync(work)


def test_an_error_of_on_item_cancels_and_joins_the_worker():
    work = Steps()

    def on_item(item: int) -> None:
        if item == 3:
            raise Boom("consumer")

    with pytest.raises(Boom, match="consumer"):
        ThreadStream.run_sync(work, on_item=on_item)
    assert work.saw_cancel and work.thread is not None and not work.thread.is_alive()


def test_closing_iterate_sync_early_cancels_and_joins_the_worker():
    work = Steps()
    items = iterate_sync(work, thread_name="agent-x")
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    items.close()
    assert work.saw_cancel and work.thread is not None and not work.thread.is_alive()
    assert work.thread.name == "agent-x"


def test_iterate_sync_returns_the_result_through_yield_from():
    def relay() -> object:
        result = yield from iterate_sync(Steps(n=3, pause=0))
        yield ("done", result)

    assert list(relay()) == [0, 1, 2, ("done", 3)]


def test_iterate_sync_starts_the_work_even_when_cancel_is_already_set():
    flag = threading.Event()
    flag.set()
    assert list(iterate_sync(Steps(), cancel=flag)) == []
    assert ThreadStream.run_sync(Steps(), cancel=flag) == -1  # the work saw the cancel itself


# -- CancelFlag ------------------------------------------------------------------------------------
def test_cancel_flag_calls_back_once_when_set():
    flag = CancelFlag()
    calls: list[str] = []
    flag.on_set(lambda: calls.append("a"))
    unhook = flag.on_set(lambda: calls.append("b"))
    unhook()
    flag.set()
    flag.set()
    assert calls == ["a"] and flag.is_set()
    flag.on_set(lambda: calls.append("late"))  # already set: called at once
    assert calls == ["a", "late"]


def test_threads_the_bridge_starts_are_listed_until_they_end():
    from agents.bridge import live_threads, start_thread

    go = threading.Event()
    thread = start_thread(go.wait, name="bridge-test-worker")
    assert thread in live_threads() and thread.daemon and thread.name == "bridge-test-worker"
    go.set()
    thread.join()
    assert thread not in live_threads()


async def test_in_thread_waits_for_its_call_when_the_caller_is_cancelled():
    """A cancelled caller does not return before the blocking call it started has: no thread is abandoned."""
    from agents.bridge import in_thread

    started, release, ended = threading.Event(), threading.Event(), []

    def blocking() -> None:
        started.set()
        release.wait(30)
        ended.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(in_thread, blocking)
        await in_thread(started.wait)  # the call is under way
        tg.cancel_scope.cancel()
        threading.Timer(0.2, release.set).start()  # it ends later: an abandoning caller would be gone by then
    assert ended == [True]


CTRL_C_SCRIPT = """
import signal
import sys
from pathlib import Path

import anyio

from agents.bridge import run_blocking

ready = Path(sys.argv[1])
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even when the suite runs in the background


async def work():
    try:
        ready.write_text("waiting")
        await anyio.sleep_forever()
    except BaseException:  # a library below that catches the one CancelledError it is sent
        pass
    ready.write_text("swallowed")
    await anyio.sleep_forever()  # asyncio's one Task.cancel() is spent: only a cancel sent again ends this


try:
    run_blocking(work)
except KeyboardInterrupt:
    print("interrupted", ready.read_text())
    sys.exit(130)
print("returned")
"""


def test_ctrl_c_ends_blocking_work_even_when_code_below_swallows_one_cancellation(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.waiting import wait_for_exit, wait_until

    script, ready = tmp_path / "ctrl_c.py", tmp_path / "ready"
    script.write_text(CTRL_C_SCRIPT)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(ready)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        wait_until(ready.exists, what="the work to start", alive=proc)
        proc.send_signal(signal.SIGINT)
        out = wait_for_exit(proc).decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted swallowed" in out  # it got past the swallowed cancellation, and was cancelled again


def test_run_blocking_returns_raises_and_leaves_ctrl_c_as_it_found_it():
    import signal

    from agents.bridge import run_blocking

    async def answer(x: int) -> int:
        await anyio.sleep(0)
        return x + 1

    async def fail() -> None:
        await anyio.sleep(0)
        raise Boom("no")

    assert run_blocking(answer, 41) == 42
    with pytest.raises(Boom, match="no"):
        run_blocking(fail)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
