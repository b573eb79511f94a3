"""API errors: each carries its HTTP status, a stable type string and a message saying what to fix."""

from __future__ import annotations

__all__ = [
    "ApiError",
    "BadRequest",
    "NotFound",
    "DocumentNotFound",
    "SessionNotFound",
    "BundledDocumentNotFound",
    "UnknownModel",
    "InvalidDocument",
    "DocumentTooLarge",
    "ContextFull",
]


class ApiError(Exception):
    """Base class: rendered as ``{"error": {"type", "message", "status"}}`` with ``status`` as HTTP code."""

    status: int = 400
    type: str = "bad_request"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> dict[str, object]:
        return {"error": {"type": self.type, "message": self.message, "status": self.status}}


class BadRequest(ApiError):
    status, type = 400, "bad_request"


class NotFound(ApiError):
    status, type = 404, "not_found"


class DocumentNotFound(NotFound):
    type = "document_not_found"


class SessionNotFound(NotFound):
    type = "session_not_found"


class BundledDocumentNotFound(NotFound):
    type = "bundled_document_not_found"


class UnknownModel(ApiError):
    # 422: the request is well-formed JSON but names a model that is not a family member.
    status, type = 422, "unknown_model"


class InvalidDocument(ApiError):
    status, type = 422, "invalid_document"


class DocumentTooLarge(ApiError):
    status, type = 413, "document_too_large"


class ContextFull(ApiError):
    # 409: the request is fine, the session's state (its context length) is what conflicts.
    status, type = 409, "context_full"
