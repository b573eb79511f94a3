"""How orchestra logs: structlog events through the standard `logging` module, silent until asked.

orchestra's modules log structured events (``run_started``, ``cache_loaded``, ``kv_store_corrupt``, ...)
through `get_logger`. While the application has not configured structlog, each event goes to the standard
library's logger of the same name (``orchestra``, ``orchestra.cache``, ``orchestra.kvstore``) as one
``event key=value ...`` message. orchestra sets no handler and no level on those loggers, so Python's
defaults apply: warnings and errors reach stderr, info lines only once the application turns logging on
(``logging.basicConfig(level=logging.INFO)``, or a handler and level on the ``orchestra`` logger).

structlog's global configuration is the application's: orchestra never calls ``structlog.configure``.
Once the application configures structlog (``orchestra serve`` does, as does ``orchestra run`` while it
shows a run), orchestra's events follow that configuration instead, whenever it was made.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import MutableMapping
from typing import Protocol

import structlog

__all__ = ["get_logger", "EventLogger"]



class _Emitter(Protocol):
    def debug(self, event: str, **fields: object) -> object: ...
    def info(self, event: str, **fields: object) -> object: ...
    def warning(self, event: str, **fields: object) -> object: ...
    def error(self, event: str, **fields: object) -> object: ...
    def exception(self, event: str, **fields: object) -> object: ...


_lock = threading.Lock()
_stdlib_loggers: dict[str, structlog.stdlib.BoundLogger] = {}


class EventLogger:
    """A structlog logger by name whose destination is chosen at each event (see the module's docstring)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def debug(self, event: str, **fields: object) -> None:
        self._logger().debug(event, **fields)

    def info(self, event: str, **fields: object) -> None:
        self._logger().info(event, **fields)

    def warning(self, event: str, **fields: object) -> None:
        self._logger().warning(event, **fields)

    def error(self, event: str, **fields: object) -> None:
        self._logger().error(event, **fields)

    def exception(self, event: str, **fields: object) -> None:
        """``error`` with the exception being handled (its traceback is the standard logger's to format)."""
        self._logger().exception(event, **fields)

    def _logger(self) -> _Emitter:
        if structlog.is_configured():
            configured: _Emitter = structlog.get_logger(self.name)
            return configured
        return _stdlib_logger(self.name)


def get_logger(name: str) -> EventLogger:
    """The logger orchestra's modules log their events with; ``name`` is also the standard logger's name."""
    return EventLogger(name)


def _stdlib_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger over ``logging.getLogger(name)``, made once per name; the global configuration is
    neither read nor changed."""
    logger = _stdlib_loggers.get(name)
    if logger is None:
        with _lock:
            logger = _stdlib_loggers.get(name)
            if logger is None:
                logger = structlog.wrap_logger(
                    logging.getLogger(name),
                    processors=[structlog.stdlib.filter_by_level, structlog.processors.StackInfoRenderer(), _render],
                    wrapper_class=structlog.stdlib.BoundLogger,
                    context_class=dict,
                ).bind()
                _stdlib_loggers[name] = logger
    return logger


def _render(_logger: object, _method: str,
            event_dict: MutableMapping[str, object]) -> tuple[tuple[str], dict[str, object]]:
    """``event key=value ...`` (values as ``repr``, strings without spaces bare), the stack appended; the
    exception goes to the standard logger as ``exc_info``, which formats its traceback."""
    event = event_dict.pop("event", "")
    exc_info = event_dict.pop("exc_info", None)
    stack = event_dict.pop("stack", None)
    parts = [str(event)] + [f"{key}={_value(value)}" for key, value in event_dict.items()]
    text = " ".join(parts)
    if stack:
        text += f"\n{stack}"
    return (text,), ({"exc_info": exc_info} if exc_info else {})


def _value(value: object) -> str:
    if isinstance(value, str) and value and not any(c.isspace() or c in "'\"=" for c in value):
        return value
    return repr(value)
