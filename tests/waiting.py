"""How tests wait: for a condition, an event, a file or a process, never for a wall-clock budget.

A 2-core CI machine running the suite beside other jobs can take minutes for what takes a second here, so
a test that fails when "it did not happen within 60 s" fails for load, not for a bug. A test waits instead
until what it waits for has happened, or until what would make it happen is gone (its thread or process
ended): that is a failure whatever the load. `HANG_GUARD_S` only stops a real hang from holding CI until
its own limit; it is far beyond anything load explains.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["HANG_GUARD_S", "wait_until", "wait_for_exit", "poll_until"]

HANG_GUARD_S = 900.0
"""Longest any single wait may take before the test is failed as hung (a bug, not a slow machine)."""


def wait_until(condition: Callable[[], object], *, what: str,
               alive: Callable[[], bool] | threading.Thread | subprocess.Popen[bytes] | None = None,
               poll_s: float = 0.02) -> None:
    """Return once `condition()` is true; fail when `alive` (a thread, a process or a predicate: whatever makes
    the condition come true) has ended first, or after `HANG_GUARD_S`. `what` names the awaited event."""
    still = _alive_check(alive)
    guard = time.monotonic() + HANG_GUARD_S
    while not condition():
        if not still():
            if condition():  # it came true as its maker ended
                return
            raise AssertionError(f"{what}: what should make it happen has ended first")
        if time.monotonic() > guard:
            raise AssertionError(f"{what}: still waiting after {HANG_GUARD_S:g} s (hung)")
        time.sleep(poll_s)


async def poll_until(fetch: Callable[[], Awaitable[T]], done: Callable[[T], bool], *, what: str,
                     poll_s: float = 0.05) -> T:
    """`fetch()`'s first value for which `done` holds (an async poll of, say, a run's status); failing as hung
    after `HANG_GUARD_S`."""
    import anyio

    guard = time.monotonic() + HANG_GUARD_S
    while True:
        value = await fetch()
        if done(value):
            return value
        if time.monotonic() > guard:
            raise AssertionError(f"{what}: still waiting after {HANG_GUARD_S:g} s (hung); last {value!r}")
        await anyio.sleep(poll_s)


def wait_for_exit(process: subprocess.Popen[bytes]) -> bytes:
    """The process's output once it has exited (failing as hung after `HANG_GUARD_S`)."""
    try:
        out, _ = process.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
        raise AssertionError(f"the process did not exit within {HANG_GUARD_S:g} s (hung):\n"
                             f"{(out or b'').decode(errors='replace')[-2000:]}") from None
    return out or b""


def _alive_check(alive: Callable[[], bool] | threading.Thread | subprocess.Popen[bytes] | None) -> Callable[[], bool]:
    if alive is None:
        return lambda: True
    if isinstance(alive, threading.Thread):
        return alive.is_alive
    if isinstance(alive, subprocess.Popen):
        process = alive
        return lambda: process.poll() is None
    return alive
