"""The one bridge between blocking work in a thread and its (async or blocking) caller.

Model work is blocking (a forward pass holds a lock and a device), callers are often async. Every
place that runs such work from async code needs the same things: items made in the thread reach the
caller as they are made, the caller leaving or being cancelled stops the work at its next check, the
thread is joined before the caller goes on (no compute outlives its caller), and the work's error
reaches the caller as it was raised. `ThreadStream` does it once:

    def work(emit: Callable[[Token], None], cancel: threading.Event) -> Result:
        for ...:
            if cancel.is_set(): ...        # stop cooperatively
            emit(token)                    # never blocks the worker
        return result

    async with ThreadStream(work) as stream:
        async for token in stream: ...
        result = await stream.result()

`run_in_thread(fn)` is the case without items; `iterate_sync` / `ThreadStream.run_sync` are the twins
for blocking callers (a Ray actor's streaming method, a driver thread). Nothing polls: items and the
end of the work wake the async side through the event loop, and `CancelFlag` (a `threading.Event` that
calls back when set) lets a cancel reach what cannot wait on an event, such as a remote actor.

The other crossings have one helper each, and the packages use only these (``scripts/code_health.py``
counts any other):

- `in_thread(fn, *args)`: a short blocking call (a tokenizer load, a file write) from async code; a
  cancelled caller waits for it to return, so no thread is abandoned;
- `run_blocking(async_fn, *args)`: async code from a blocking caller (a script, the CLI), in an event
  loop of its own;
- `call_in_loop(async_fn, *args)`: from a worker thread anyio started, a coroutine on its caller's loop;
- `start_thread(target, name=...)`: a long-lived worker thread a component owns and joins when it closes
  (`live_threads()` lists those still running).
"""

from __future__ import annotations

import asyncio
import functools
import queue
import signal
import sys
import threading
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator
from types import TracebackType
from typing import Generic, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from anyio.abc import TaskGroup

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["CancelFlag", "ThreadStream", "WorkerCancelledError", "call_in_loop", "in_thread", "iterate_sync",
           "live_threads", "run_blocking", "run_in_thread", "start_thread"]

T = TypeVar("T")
R = TypeVar("R")

Work = Callable[[Callable[[T], None], threading.Event], R]
"""``fn(emit, cancel) -> result``: runs in the worker thread; checks ``cancel`` between steps."""


class WorkerCancelledError(RuntimeError):
    """The work was cancelled before its thread started it, so it has no result (and did no work)."""


class CancelFlag(threading.Event):
    """A `threading.Event` that also calls back when set (in the setting thread, once per callback).

    Waiting on "cancelled, or done" needs one thing to wait on; a remote worker cannot wait on a local
    event at all. A callback sends the cancel on at once (e.g. to a Ray actor) instead of a thread
    checking the flag every few milliseconds. Callbacks must be quick and must not raise.
    """

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], object]] = []
        self._callbacks_lock = threading.Lock()

    def set(self) -> None:
        super().set()
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call `callback` when the flag is set (now, if it already is); returns a function that unhooks it."""
        with self._callbacks_lock:
            if not self.is_set():
                self._callbacks.append(callback)

                def unhook() -> None:
                    with self._callbacks_lock:
                        if callback in self._callbacks:
                            self._callbacks.remove(callback)

                return unhook
        callback()  # set already (or being set, past its hand-out of callbacks): exactly once either way
        return lambda: None


def _call_soon(token: anyio.lowlevel.EventLoopToken, fn: Callable[[], object]) -> bool:
    """Schedule `fn` on the event loop of `token` without waiting for it; False when that loop is gone.

    `anyio.from_thread.run_sync` waits for the loop to run the call, which would make a worker wait on a
    busy loop once per item; the loops' own thread-safe schedulers do not wait. An unknown backend falls
    back to anyio's (waiting) call.
    """
    native = token.native_token
    try:
        if isinstance(native, asyncio.AbstractEventLoop):
            native.call_soon_threadsafe(fn)
        elif hasattr(native, "run_sync_soon"):  # pragma: no cover - trio's TrioToken (the project runs on asyncio)
            native.run_sync_soon(fn)
        else:  # pragma: no cover - no other backend today
            anyio.from_thread.run_sync(fn, token=token)
    except RuntimeError:  # the loop is closed (anyio's RunFinishedError, trio's RunFinishedError are RuntimeErrors)
        return False
    return True


class ThreadStream(Generic[T, R]):
    """``fn(emit, cancel)`` in a worker thread; its items as an async iterator, then its result.

    - The thread is an anyio worker thread (so ``anyio.from_thread`` works in it, and `limiter` bounds
      it), or a dedicated daemon thread named `thread_name` (work that must not hold one of anyio's
      default 40 worker threads for long, e.g. a served reply). The work starts in the background
      when the block is entered; one still waiting for `limiter` when the block is left never starts.
    - `emit` appends to an unbounded buffer and wakes the async side; it never blocks the worker. An item
      emitted after the async side has left sets `cancel` instead.
    - Leaving the block before the work is done (``break``, an error, a cancelled scope) sets `cancel`
      and waits for the thread, shielded: the work stops at its next check, and nothing runs after the
      block. A result made but never handed out (the caller was cancelled meanwhile) goes to `discard`.
    - The work's error is raised unwrapped, by the iteration (once the items before it are consumed)
      and by `result`; the caller's own error leaves the block as it was raised (no exception group).
    """

    def __init__(self, fn: Work[T, R], *, cancel: threading.Event | None = None,
                 limiter: anyio.CapacityLimiter | None = None, thread_name: str | None = None,
                 discard: Callable[[R], object] | None = None) -> None:
        self.cancel: threading.Event = cancel if cancel is not None else CancelFlag()
        """Set (from any thread) to ask the work to stop; the work sees it as its second argument."""
        self._fn = fn
        self._limiter = limiter
        self._thread_name = thread_name
        self._discard = discard
        self._items: deque[T] = deque()
        self._started = False
        self._done = False
        self._left = False  # the async side has left the block: emitted items have nobody to go to
        self._delivered = False
        self._result: R | None = None
        self._error: BaseException | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._wakeup: anyio.Event | None = None
        self._finished: anyio.Event | None = None
        self._start_scope: anyio.CancelScope | None = None
        self._tg: TaskGroup | None = None

    # -- the worker thread ------------------------------------------------------------------------
    def _emit(self, item: T) -> None:
        if self._left:
            self.cancel.set()
            return
        self._items.append(item)
        assert self._token is not None
        if not _call_soon(self._token, self._wake):
            self.cancel.set()  # the event loop is gone: nobody will read this

    def _body(self) -> None:
        if self._left:  # the caller left while this job was queued for a thread: do no work at all
            return
        self._started = True
        try:
            self._result = self._fn(self._emit, self.cancel)
        except BaseException as exc:  # handed to the async side, unwrapped
            self._error = exc

    # -- the event loop ---------------------------------------------------------------------------
    def _wake(self) -> None:
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.set()

    async def _run(self) -> None:
        assert self._start_scope is not None
        try:
            with self._start_scope:  # cancelled when the block is left early: a queued job never starts
                if self._thread_name is None:
                    await anyio.to_thread.run_sync(self._body, limiter=self._limiter, abandon_on_cancel=False)
                elif self._limiter is not None:
                    async with self._limiter:
                        await self._in_dedicated_thread(self._thread_name)
                else:
                    await self._in_dedicated_thread(self._thread_name)
        except Exception as exc:  # no thread to be had (RuntimeError: can't start new thread): the work's error
            self._error = exc
        finally:
            self._done = True
            assert self._finished is not None
            self._finished.set()
            self._wake()

    async def _in_dedicated_thread(self, name: str) -> None:
        exited = anyio.Event()
        token = self._token
        assert token is not None

        def target() -> None:
            try:
                self._body()
            finally:
                _call_soon(token, exited.set)

        thread = start_thread(target, name=name)
        with anyio.CancelScope(shield=True):  # the thread is running: wait for it, whatever is cancelled
            await exited.wait()
        thread.join()  # it has only its return left to do

    async def __aenter__(self) -> ThreadStream[T, R]:
        if self._tg is not None:
            raise RuntimeError("a ThreadStream runs its work once; make a new one")
        self._token = anyio.lowlevel.current_token()
        self._finished = anyio.Event()
        self._start_scope = anyio.CancelScope()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                         tb: TracebackType | None) -> bool | None:
        assert self._tg is not None and self._start_scope is not None
        self._left = True
        if not self._done:
            self.cancel.set()
            self._start_scope.cancel()
        try:
            return await self._tg.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # `_run` never raises, so the group holds only what the block raised: let that leave as it was
            if exc is not None and len(group.exceptions) == 1 and group.exceptions[0] is exc:
                return False
            raise
        finally:
            self._items.clear()
            if self._done and self._error is None and self._started and not self._delivered:
                if self._discard is not None:
                    self._discard(self._result)  # type: ignore[arg-type]  # R, set by a successful run

    # -- the consumer -----------------------------------------------------------------------------
    def __aiter__(self) -> ThreadStream[T, R]:
        return self

    async def __anext__(self) -> T:
        while True:
            if self._items:
                # a step of the iteration is a cancel point even when the item is already buffered: a scope
                # cancelled after item n must not receive item n + 1
                await anyio.lowlevel.checkpoint_if_cancelled()
                return self._items.popleft()
            if self._done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            if self._tg is None:
                raise RuntimeError("iterate a ThreadStream inside its `async with` block")
            if self._wakeup is None:  # one event for all who wait (set, and dropped, by the next wake)
                self._wakeup = anyio.Event()
            await self._wakeup.wait()

    @property
    def done(self) -> bool:
        """The work has ended (returned, raised, or was cancelled before it started)."""
        return self._done

    @property
    def started(self) -> bool:
        """The work's function was called (False: it was cancelled while queued, and did nothing)."""
        return self._started

    async def wait(self) -> None:
        """Wait until the work has ended (from any task of this event loop); its items stay buffered."""
        if self._finished is None:
            raise RuntimeError("the ThreadStream has not been entered")
        await self._finished.wait()

    async def result(self) -> R:
        """The work's return value, once it has ended (its error, raised, if it failed)."""
        await self.wait()
        return self.result_nowait()

    def result_nowait(self) -> R:
        """`result` for an ended work: raises RuntimeError while it runs, WorkerCancelledError if it never started."""
        if not self._done:
            raise RuntimeError("the work has not ended yet")
        if self._error is not None:
            raise self._error
        if not self._started:
            raise WorkerCancelledError("the work was cancelled before it started")
        self._delivered = True
        return self._result  # type: ignore[return-value]  # R, set by a successful run

    # -- the blocking twin ------------------------------------------------------------------------
    @staticmethod
    def run_sync(fn: Work[T, R], *, on_item: Callable[[T], object] | None = None,
                 cancel: threading.Event | None = None, thread_name: str | None = None) -> R:
        """`fn` in a thread of its own, each item handed to `on_item` in this thread; returns its result.

        The blocking twin of ``async with ThreadStream(fn)``: an error of `on_item` (or a KeyboardInterrupt
        here) sets `cancel` and joins the thread before it propagates.
        """
        items = iterate_sync(fn, cancel=cancel, thread_name=thread_name)
        while True:
            try:
                item = next(items)
            except StopIteration as stop:
                result: R = stop.value
                return result
            if on_item is not None:
                try:
                    on_item(item)
                except BaseException:
                    items.close()
                    raise


class _Ended(Generic[R]):
    """The last entry of `iterate_sync`'s queue: the work ended with this result or error."""

    __slots__ = ("result", "error")

    def __init__(self, result: R | None, error: BaseException | None) -> None:
        self.result, self.error = result, error


def iterate_sync(fn: Work[T, R], *, cancel: threading.Event | None = None,
                 thread_name: str | None = None) -> Generator[T, None, R]:
    """`fn` in a thread of its own; yields each item as it is emitted and returns `fn`'s result.

    For blocking callers (``result = yield from iterate_sync(work)`` in a generator). The work always
    starts (it sees an already set `cancel` itself); closing the generator early sets `cancel` and joins
    the thread. The work's error is raised unwrapped. Waits on a queue: no polling.
    """
    flag = cancel if cancel is not None else CancelFlag()
    entries: queue.SimpleQueue[T | _Ended[R]] = queue.SimpleQueue()

    def target() -> None:
        try:
            result = fn(entries.put, flag)
        except BaseException as exc:  # handed to the caller's thread
            entries.put(_Ended(None, exc))
        else:
            entries.put(_Ended(result, None))

    thread = start_thread(target, name=thread_name or f"bridge-{getattr(fn, '__name__', 'work')}")
    ended = False
    try:
        while True:
            entry = entries.get()
            if isinstance(entry, _Ended):
                ended = True
                if entry.error is not None:
                    raise entry.error
                return entry.result  # type: ignore[return-value]  # R, from a successful run
            yield entry
    finally:
        if not ended:  # closed early, or an error was thrown in: stop the work and wait for it
            flag.set()
        thread.join()


async def run_in_thread(fn: Callable[[threading.Event], R], *, limiter: anyio.CapacityLimiter | None = None,
                        discard: Callable[[R], object] | None = None) -> R:
    """``fn(cancel)`` in an anyio worker thread: `ThreadStream` for work that emits nothing.

    Cancelling the caller sets `cancel` and waits for `fn` to return (a job still queued never starts);
    a result made meanwhile goes to `discard` (e.g. releasing a lease nobody will get).
    """
    def work(_emit: Callable[[object], None], cancel: threading.Event) -> R:
        return fn(cancel)

    async with ThreadStream(work, limiter=limiter, discard=discard) as stream:
        return await stream.result()


async def in_thread(fn: Callable[..., R], *args: object, limiter: anyio.CapacityLimiter | None = None) -> R:
    """``fn(*args)``, a blocking call, from async code: in an anyio worker thread (context variables follow it).

    Cancelling the caller waits for `fn` to return: its thread is never abandoned. Work that can stop early
    takes a cancel event instead: `run_in_thread`.
    """
    return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=limiter, abandon_on_cancel=False)


def run_blocking(fn: Callable[..., Awaitable[R]], *args: object) -> R:
    """``await fn(*args)`` from blocking code, in an event loop of its own; RuntimeError in a thread that already
    runs one (the caller should await `fn` there instead).

    In the main thread, with Python's own Ctrl-C handling in place, Ctrl-C cancels the work and then raises
    KeyboardInterrupt here, once everything the work started has unwound (its finally blocks, its threads
    joined, a Ray executor's actors stopped). The cancellation is anyio's, delivered again at every await until
    the work has left: asyncio's own, one `Task.cancel()` of the main task, is lost for good when any code
    below catches that one CancelledError (a library's broad handler, a cancel scope exiting at the same
    moment), and the run then waits forever on what it was waiting for. A second Ctrl-C raises
    KeyboardInterrupt in the loop, as asyncio's second one does, and the loop's close cancels what is left.
    """
    hook = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler

    async def call() -> R:
        if not hook:
            return await fn(*args)
        loop = asyncio.get_running_loop()
        scope = anyio.CancelScope()

        def interrupt() -> None:
            if scope.cancel_called:  # the second Ctrl-C: stop waiting for the work to unwind
                raise KeyboardInterrupt
            scope.cancel()

        try:
            loop.add_signal_handler(signal.SIGINT, interrupt)
        except (NotImplementedError, RuntimeError):  # a loop without signal handlers (Windows): asyncio's own
            return await fn(*args)
        try:
            with scope:
                return await fn(*args)
        except Exception as exc:  # the work's own error for being cancelled (a cancelled generation, say)
            if scope.cancel_called:
                raise KeyboardInterrupt from exc
            raise
        finally:
            loop.remove_signal_handler(signal.SIGINT)
        raise KeyboardInterrupt  # the work has unwound from the Ctrl-C that cancelled it

    return anyio.run(call)


def call_in_loop(fn: Callable[..., Coroutine[object, object, R]], *args: object) -> R:
    """``await fn(*args)`` on the event loop that started this worker thread (`in_thread`, `run_in_thread`,
    `ThreadStream`); blocks this thread until it is done."""
    return anyio.from_thread.run(fn, *args)


_LIVE: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def start_thread(target: Callable[..., object], *, name: str, args: tuple[object, ...] = (),
                 kwargs: dict[str, object] | None = None) -> threading.Thread:
    """A started daemon thread named `name` running ``target(*args, **kwargs)``; its owner joins it when done.

    Daemon, so a thread its owner never joins cannot keep the interpreter from exiting; named, so a dump of
    the threads says whose it is. `live_threads()` lists the ones still running.
    """
    thread = threading.Thread(target=target, name=name, args=args, kwargs=kwargs or {}, daemon=True)
    thread.start()
    _LIVE.add(thread)
    return thread


def live_threads() -> list[threading.Thread]:
    """The threads `start_thread` started that are still running."""
    return [t for t in list(_LIVE) if t.is_alive()]
