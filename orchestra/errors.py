"""Typed errors raised by the orchestra package; each message says what to fix."""

from __future__ import annotations

__all__ = [
    "OrchestraError",
    "FamilyError",
    "GGUFUnavailableError",
    "CorruptGGUFError",
    "FamilyHomeError",
    "FamilyBuildError",
    "MemberNotFoundError",
    "PipelineError",
    "PipelineFileError",
    "CycleError",
    "UnknownAgentError",
    "UnknownModelError",
    "CrossFamilyError",
    "DocumentError",
    "DevicePlacementError",
    "MappingUnavailableError",
]


class OrchestraError(Exception):
    """Base class of every error orchestra raises on purpose."""


class FamilyError(OrchestraError):
    """Something is wrong with the model family or its home directory."""


class GGUFUnavailableError(FamilyError):
    """The SmolLM2 GGUF could not be found locally nor downloaded."""


class CorruptGGUFError(FamilyError):
    """The GGUF file exists but cannot be parsed (truncated or not a GGUF)."""


class FamilyHomeError(FamilyError):
    """The family home directory cannot be used (not a directory, not writable)."""


class FamilyBuildError(FamilyError):
    """Building a family member failed; nothing half-written was left behind."""


class MemberNotFoundError(FamilyError):
    """A family member was asked for that is not built or not known."""


class PipelineError(OrchestraError):
    """A pipeline definition is invalid; raised before any model loads."""


class PipelineFileError(PipelineError):
    """A pipeline file cannot be read or does not validate; names the file, the field and the fix."""


class CycleError(PipelineError):
    """The agents' upstream references form a cycle."""


class UnknownAgentError(PipelineError):
    """An agent names an upstream agent that does not exist."""


class UnknownModelError(PipelineError):
    """An agent or the source names a model that is not in the pipeline's family."""


class CrossFamilyError(PipelineError):
    """A model is not from the pipeline's family (different tokenizer), so its KV cannot be shared."""


class DocumentError(OrchestraError):
    """The document cannot be processed (empty, or longer than a model allows)."""


class DevicePlacementError(OrchestraError):
    """A model does not fit on the device chosen for it, or the device does not exist."""


class MappingUnavailableError(OrchestraError):
    """No mapping exists for a (source, target) pair and the pipeline forbids calibrating one."""
