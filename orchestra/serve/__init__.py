"""`orchestra serve`: an OpenAI-compatible server whose prefix cache spans the whole family.

    from orchestra.serve import ServeConfig, create_app, ServeEngine

`create_app(config)` is an ASGI app to run with uvicorn or mount in another app; `ServeEngine` is
the same thing without HTTP, for async backends that call it directly.

May import: ``orchestra.runs`` and everything below it; never the CLI, the builder or the benchmarks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestra.serve._app import create_app
from orchestra.serve._config import ServeConfig
from orchestra.serve._engine import CacheInfo, Generation, ServeEngine, render_messages, tune_allocator
from orchestra.serve._errors import (
    ApiError,
    BadRequest,
    ConfigError,
    ContextLengthExceeded,
    ExecutorFailed,
    Forbidden,
    ModelNotFound,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    Unauthorized,
    Unavailable,
)
from orchestra.serve._metrics import ServeMetrics
from orchestra.serve._process import ServerProcess, ServerStartError, free_port, start_server
from orchestra.serve._schemas import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage
from orchestra.serve._vllm import create_vllm_app

if TYPE_CHECKING:
    from orchestra.serve._room import ROOM_CHUNK, RoomLayer, add_row, room_cache

__all__ = [
    "create_app",
    "create_vllm_app",
    "ServeConfig",
    "ServeEngine",
    "Generation",
    "CacheInfo",
    "ServeMetrics",
    "ServerProcess",
    "ServerStartError",
    "start_server",
    "free_port",
    "render_messages",
    "tune_allocator",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ApiError",
    "BadRequest",
    "ConfigError",
    "ContextLengthExceeded",
    "ExecutorFailed",
    "Forbidden",
    "ModelNotFound",
    "PayloadTooLarge",
    "RateLimited",
    "RequestTimeout",
    "Unauthorized",
    "Unavailable",
]
__all__ += ["RoomLayer", "room_cache", "add_row", "ROOM_CHUNK"]

# the batch decoder's cache layers subclass a transformers class: imported only when asked for
_LAZY = {"RoomLayer", "room_cache", "add_row", "ROOM_CHUNK"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from orchestra.serve import _room

        return getattr(_room, name)
    raise AttributeError(f"module 'orchestra.serve' has no attribute {name!r}")
