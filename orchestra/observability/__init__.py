"""Observability: what a run tells the people watching it.

Owns the typed events a run streams (for chat backends, logs and the live view), the run report (per
agent: which cache it ran on, what the gates said, what it cost and saved), Prometheus metrics and
OpenTelemetry traces, both made from the events.

May import: ``orchestra.familycache`` (the cache steps events carry), ``orchestra.errors`` and
libraries (prometheus-client and OpenTelemetry load only when used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestra._exports import lazy_exports

if TYPE_CHECKING:
    from orchestra.observability.events import AnyEvent, Event
    from orchestra.observability.metrics import PipelineMetrics, RunMetricsSink
    from orchestra.observability.report import AgentReport, ChunkSummary, ModelCacheReport, RunReport
    from orchestra.observability.tracing import RunTracer, configure_from_env, run_tracer

__all__ = [
    "Event",
    "AnyEvent",
    "RunReport",
    "AgentReport",
    "ModelCacheReport",
    "ChunkSummary",
    "PipelineMetrics",
    "RunMetricsSink",
    "RunTracer",
    "run_tracer",
    "configure_from_env",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "orchestra.observability.events": (
            "AnyEvent",
            "Event",
        ),
        "orchestra.observability.metrics": (
            "PipelineMetrics",
            "RunMetricsSink",
        ),
        "orchestra.observability.report": (
            "AgentReport",
            "ChunkSummary",
            "ModelCacheReport",
            "RunReport",
        ),
        "orchestra.observability.tracing": (
            "RunTracer",
            "configure_from_env",
            "run_tracer",
        ),
    },
)
