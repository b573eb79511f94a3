"""Pipelines: what a run will do, as data, checked before anything loads.

Owns the pipeline specification (agents, steps, members, settings; loaded from YAML/JSON or built in
Python), its DAG (validation, levels, drawing), Python steps and routing conditions, runtime inputs,
and the reading of a spec sent by someone else before it is built (what code and server places it
names).

May import: ``orchestra.familycache`` (the settings a spec carries for it), ``orchestra.models``,
``orchestra.errors``, ``agents`` and ``mappings``. Runs, observability and the server stand on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestra._exports import lazy_exports

if TYPE_CHECKING:
    from orchestra.pipelines.graph import build_graph, descendants, levels, to_mermaid
    from orchestra.pipelines.inputs import InputSpec, parse_input_args, resolve_inputs
    from orchestra.pipelines.spec import (
        AgentNode,
        ChunkingPolicy,
        KVStoreSettings,
        MappingPolicy,
        PipelineSettings,
        PipelineSpec,
        load_pipeline,
        pipeline_mermaid,
    )
    from orchestra.pipelines.steps import Condition, StepNode, call_step, condition_holds
    from orchestra.pipelines.trust import ClientSpecReach, check_client_spec, client_spec_reach

__all__ = [
    "PipelineSpec",
    "AgentNode",
    "StepNode",
    "Condition",
    "PipelineSettings",
    "MappingPolicy",
    "ChunkingPolicy",
    "KVStoreSettings",
    "load_pipeline",
    "pipeline_mermaid",
    "InputSpec",
    "parse_input_args",
    "resolve_inputs",
    "build_graph",
    "levels",
    "descendants",
    "to_mermaid",
    "call_step",
    "condition_holds",
    "ClientSpecReach",
    "client_spec_reach",
    "check_client_spec",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "orchestra.pipelines.graph": (
            "build_graph",
            "descendants",
            "levels",
            "to_mermaid",
        ),
        "orchestra.pipelines.inputs": (
            "InputSpec",
            "parse_input_args",
            "resolve_inputs",
        ),
        "orchestra.pipelines.spec": (
            "AgentNode",
            "ChunkingPolicy",
            "KVStoreSettings",
            "MappingPolicy",
            "PipelineSettings",
            "PipelineSpec",
            "load_pipeline",
            "pipeline_mermaid",
        ),
        "orchestra.pipelines.steps": (
            "Condition",
            "StepNode",
            "call_step",
            "condition_holds",
        ),
        "orchestra.pipelines.trust": (
            "ClientSpecReach",
            "check_client_spec",
            "client_spec_reach",
        ),
    },
)
