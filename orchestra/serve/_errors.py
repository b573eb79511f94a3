"""Errors of the server, each with the HTTP status and the OpenAI error type and code it is answered with."""

from __future__ import annotations

from orchestra.errors import OrchestraError

__all__ = [
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


class ApiError(OrchestraError):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with `status`."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Response headers the error is answered with (none by default)."""
        return {}


class BadRequest(ApiError):
    status, code = 400, "invalid_request"


class ContextLengthExceeded(ApiError):
    status, code = 400, "context_length_exceeded"


class Unauthorized(ApiError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class Forbidden(ApiError):
    """The request asks the server to import or run Python, or to use a folder, file or address, that its
    operator did not allow (the message names the option that would)."""

    status, type, code = 403, "permission_error", "not_allowed"


class ModelNotFound(ApiError):
    status, code = 404, "model_not_found"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class RateLimited(ApiError):
    status, type, code = 429, "rate_limit_error", "queue_full"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))
        """Seconds a client should wait before retrying: about when a queue place frees up."""

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class RequestTimeout(ApiError):
    status, type, code = 504, "timeout_error", "request_timeout"


class Unavailable(ApiError):
    status, type, code = 503, "service_unavailable", "not_ready"


class ExecutorFailed(ApiError):
    """The executor could not do the request's model work: under the ray executor, a member's actor died
    (its message names the actor and node; Ray restarts it and the next request uses it) or cannot start."""

    status, type, code = 503, "server_error", "executor_failed"


class ConfigError(OrchestraError):
    """The server's own settings are wrong (a user mistake at start-up: exit 2 with this message)."""
