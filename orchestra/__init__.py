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

from orchestra._exports import lazy_exports
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
from orchestra.models.quantize import quiet_torchao_import

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
    from orchestra.family import FamilyManifest, build_family, load_family
    from orchestra.familycache import CacheLease, CachePolicy, FamilyCache, KVStore
    from orchestra.familycache.gates import GatePolicy
    from orchestra.models.modelref import AdapterSpec, ModelRef, QuantizeSpec
    from orchestra.observability.report import AgentReport, RunReport
    from orchestra.pipelines.inputs import InputSpec
    from orchestra.pipelines.spec import AgentNode, ExecutorSpec, PipelineSpec, load_pipeline
    from orchestra.runs.checkpoint import Checkpointer, MemoryCheckpointer, SqliteCheckpointer
    from orchestra.runs.scheduler import Orchestra
    from orchestra.runs.session import Session

__getattr__ = lazy_exports(
    __name__,
    {
        "orchestra.builder": ("Pipeline",),
        "orchestra.runs.session": ("Session",),
        "orchestra.runs.checkpoint": (
            "Checkpointer",
            "MemoryCheckpointer",
            "SqliteCheckpointer",
        ),
        "orchestra.familycache": (
            "KVStore",
            "FamilyCache",
            "CachePolicy",
            "CacheLease",
        ),
        "orchestra.pipelines.spec": (
            "PipelineSpec",
            "AgentNode",
            "ExecutorSpec",
            "load_pipeline",
        ),
        "orchestra.runs.scheduler": ("Orchestra",),
        "orchestra.observability.report": (
            "RunReport",
            "AgentReport",
        ),
        "orchestra.pipelines.inputs": ("InputSpec",),
        "orchestra.familycache.gates": ("GatePolicy",),
        "orchestra.family": (
            "build_family",
            "load_family",
            "FamilyManifest",
        ),
        "orchestra.models.modelref": (
            "ModelRef",
            "AdapterSpec",
            "QuantizeSpec",
        ),
    },
)
