"""Whether a blocking entry point (``run_sync``, a session's ``ask``) was called inside a running event loop."""

from __future__ import annotations

import asyncio

from orchestra.errors import EventLoopRunningError

__all__ = ["refuse_inside_event_loop"]


def refuse_inside_event_loop() -> None:
    """Raise EventLoopRunningError when called inside a running event loop (a blocking call would stall it)."""
    running: str | None = None
    try:
        asyncio.get_running_loop()
        running = "asyncio"
    except RuntimeError:
        try:
            import sniffio

            running = sniffio.current_async_library()
        except Exception:  # sniffio missing, or no async library running
            running = None
    if running is not None:
        raise EventLoopRunningError(
            f"Pipeline.run_sync() was called inside a running {running} event loop, which it would block; "
            f"in async code use `await pipeline.run(document)` (or `async for event in pipeline.stream(document)`)"
        )
