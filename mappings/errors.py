"""Typed errors raised by the mappings package; each message says what to do about it."""

from __future__ import annotations

__all__ = [
    "MappingError",
    "TokenizerMismatchError",
    "ShapeMismatchError",
    "NonFiniteKVError",
    "CorpusTooSmallError",
    "DocumentTooLongError",
    "DocumentTooShortError",
    "StaleMappingError",
    "CorruptMappingError",
    "UnsupportedModelError",
    "MappingOutputError",
]


class MappingError(Exception):
    """Base class of every error the mappings package raises on purpose."""


class TokenizerMismatchError(MappingError):
    """Source and target tokenize differently: they are not one family and KV cannot be carried over."""


class ShapeMismatchError(MappingError):
    """A cache, map or model does not have the layer/head/head-size layout the operation needs."""


class NonFiniteKVError(MappingError):
    """A captured or mapped key/value tensor holds NaN or inf."""


class CorpusTooSmallError(MappingError):
    """The calibration corpus is empty or gives fewer tokens than asked for."""


class DocumentTooLongError(MappingError):
    """A document (or cache) is longer than the model's maximum positions."""


class DocumentTooShortError(MappingError):
    """A document has fewer tokens than the evaluation needs."""


class StaleMappingError(MappingError):
    """A mapping was made for other models (fingerprints differ) or by an older mapping format."""


class CorruptMappingError(MappingError):
    """A mapping directory is incomplete, truncated or not valid (bad JSON, bad safetensors, hash mismatch)."""


class UnsupportedModelError(MappingError):
    """The model's attention or cache layout is not one this package can capture or rebuild."""


class MappingOutputError(MappingError):
    """A mapping cannot be written where asked (a file, or a folder holding other things)."""
