"""`orchestra serve`: an OpenAI-compatible server whose prefix cache spans the whole family.

    from orchestra.serve import ServeConfig, create_app, ServeEngine

`create_app(config)` is an ASGI app to run with uvicorn or mount in another app; `ServeEngine` is
the same thing without HTTP, for async backends that call it directly.
"""

from __future__ import annotations

from orchestra.serve._app import create_app
from orchestra.serve._config import ServeConfig
from orchestra.serve._engine import CacheInfo, Generation, ServeEngine, render_messages, tune_allocator
from orchestra.serve._errors import (
    ApiError,
    BadRequest,
    ConfigError,
    ContextLengthExceeded,
    ExecutorFailed,
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

__all__ = [
    "create_app",
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
    "ModelNotFound",
    "PayloadTooLarge",
    "RateLimited",
    "RequestTimeout",
    "Unauthorized",
    "Unavailable",
]
