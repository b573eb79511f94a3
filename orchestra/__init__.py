"""orchestra: multi-agent pipelines over one long document on a family of LLMs, prefilling it once.

    from orchestra import Pipeline
    p = Pipeline("brief", source="root")
    p.agent("summarizer", model="root")
    p.agent("key_facts", model="finetuned")
    report = p.run_sync(open("doc.txt").read())

Heavy dependencies (torch, transformers) load only when a name that needs them is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestra.errors import (
    ActorLostError,
    AdapterBaseError,
    AdapterError,
    CorruptGGUFError,
    CrossFamilyError,
    CycleError,
    DevicePlacementError,
    DocumentError,
    ExecutorError,
    ExecutorUnavailableError,
    FamilyBuildError,
    FamilyError,
    FamilyHomeError,
    GGUFUnavailableError,
    HubModelError,
    MappingUnavailableError,
    MemberNotFoundError,
    ModelFolderError,
    ModelNotCachedError,
    ModelReferenceError,
    OrchestraError,
    PipelineError,
    PipelineFileError,
    QuantizeBaseError,
    QuantizeError,
    RunInputError,
    RunResumeError,
    SessionError,
    UnknownAgentError,
    UnknownModelError,
)
from orchestra.quantize import quiet_torchao_import

__version__ = "0.1.0"

# transformers imports torchao (when installed) as it loads any model, whose import logs warnings about
# CUDA-only kernels on a CPU build: filtered before anything can import it (cheap: two logging filters)
quiet_torchao_import()

__all__ = [
    "__version__",
    # the Python API
    "Pipeline",
    "PipelineSpec",
    "AgentNode",
    "ExecutorSpec",
    "load_pipeline",
    "Orchestra",
    "RunReport",
    "AgentReport",
    "InputSpec",
    "Session",
    "Checkpointer",
    "MemoryCheckpointer",
    "SqliteCheckpointer",
    # the core: one cache for the whole family
    "FamilyCache",
    "CachePolicy",
    "CacheLease",
    "KVStore",
    "GatePolicy",
    # the family
    "build_family",
    "load_family",
    "FamilyManifest",
    # model references: a local folder or a Hugging Face Hub id; a LoRA adapter over a declared model or a
    # quantized view of one
    "ModelRef",
    "AdapterSpec",
    "QuantizeSpec",
    # errors
    "OrchestraError",
    "FamilyError",
    "FamilyHomeError",
    "FamilyBuildError",
    "GGUFUnavailableError",
    "CorruptGGUFError",
    "MemberNotFoundError",
    "PipelineError",
    "PipelineFileError",
    "CycleError",
    "RunInputError",
    "RunResumeError",
    "SessionError",
    "UnknownAgentError",
    "UnknownModelError",
    "ModelReferenceError",
    "ModelFolderError",
    "ModelNotCachedError",
    "HubModelError",
    "AdapterError",
    "AdapterBaseError",
    "QuantizeError",
    "QuantizeBaseError",
    "CrossFamilyError",
    "DocumentError",
    "DevicePlacementError",
    "MappingUnavailableError",
    "ExecutorError",
    "ExecutorUnavailableError",
    "ActorLostError",
]

if TYPE_CHECKING:
    from orchestra.builder import Pipeline
    from orchestra.checkpoint import Checkpointer, MemoryCheckpointer, SqliteCheckpointer
    from orchestra.family import FamilyManifest, build_family, load_family
    from orchestra.familycache import CacheLease, CachePolicy, FamilyCache, KVStore
    from orchestra.gates import GatePolicy
    from orchestra.inputs import InputSpec
    from orchestra.modelref import AdapterSpec, ModelRef, QuantizeSpec
    from orchestra.pipeline import AgentNode, ExecutorSpec, PipelineSpec, load_pipeline
    from orchestra.report import AgentReport, RunReport
    from orchestra.scheduler import Orchestra
    from orchestra.session import Session

_LAZY = {
    "Pipeline": "orchestra.builder",
    "Session": "orchestra.session",
    "Checkpointer": "orchestra.checkpoint",
    "MemoryCheckpointer": "orchestra.checkpoint",
    "SqliteCheckpointer": "orchestra.checkpoint",
    "KVStore": "orchestra.familycache",
    "PipelineSpec": "orchestra.pipeline",
    "AgentNode": "orchestra.pipeline",
    "ExecutorSpec": "orchestra.pipeline",
    "load_pipeline": "orchestra.pipeline",
    "Orchestra": "orchestra.scheduler",
    "RunReport": "orchestra.report",
    "AgentReport": "orchestra.report",
    "InputSpec": "orchestra.inputs",
    "FamilyCache": "orchestra.familycache",
    "CachePolicy": "orchestra.familycache",
    "CacheLease": "orchestra.familycache",
    "GatePolicy": "orchestra.gates",
    "build_family": "orchestra.family",
    "load_family": "orchestra.family",
    "FamilyManifest": "orchestra.family",
    "ModelRef": "orchestra.modelref",
    "AdapterSpec": "orchestra.modelref",
    "QuantizeSpec": "orchestra.modelref",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'orchestra' has no attribute {name!r}")
