"""Prometheus metrics of pipeline runs, made from their typed events (the server's chat metrics are in
``orchestra.serve``; these are the runs').

`PipelineMetrics` registers its series once in a registry (the process-wide default, or the server's);
`sink(pipeline)` gives an event sink for one run. Series (label ``model_name`` as vLLM's, for members, as the
server's own series have it too):

- ``orchestra_pipeline_runs_total{pipeline, status}`` and ``orchestra_pipeline_run_seconds{pipeline}``;
- ``orchestra_pipeline_agents_total{pipeline, status}`` (succeeded, failed, skipped, degenerate, cancelled);
- ``orchestra_pipeline_cache_paths_total{model_name, path}``: the cache each agent ran on (exact, mapped,
  reprefilled);
- ``orchestra_pipeline_fallbacks_total{model_name, reason}``: mapped caches refused, by the gate that refused;
- ``orchestra_pipeline_cache_step_seconds_total{model_name, step}``: seconds of prefill, map, repair, gate,
  load (disk tier), ... steps;
- ``orchestra_pipeline_prefill_seconds_total{kind}``: document prefill seconds spent and (estimated) saved;
- ``orchestra_pipeline_agent_ttft_seconds{model_name}`` and ``orchestra_pipeline_generated_tokens_total
  {model_name}``.

A batch job writes them for node_exporter's textfile collector (`write_textfile`, as `orchestra run
--metrics FILE` does); a service exposes its registry as usual. Needs ``prometheus-client`` (the ``serve``
extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from orchestra.observability.events import Event
    from orchestra.observability.report import RunReport

__all__ = ["PipelineMetrics", "RunMetricsSink", "fallback_reason_label"]

_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_RUN_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)


def fallback_reason_label(reason: str | None) -> str:
    """A bounded label for a fallback's free-text reason: the gate that refused (probe, offline, ...), or 'other'."""
    text = (reason or "").strip().lower()
    for gate in ("probe", "offline", "shadow", "mapping", "breaker"):
        if text.startswith(gate) or f"{gate} gate" in text:
            return gate
    return "other"


def _require_prometheus() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        from agents.errors import MissingDependencyError
        from orchestra.errors import install_command

        raise MissingDependencyError(f"pipeline metrics need prometheus-client: {install_command('serve')}") from exc


class PipelineMetrics:
    """The pipeline series, registered once in `registry` (default: prometheus_client's global one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        _require_prometheus()
        from prometheus_client import REGISTRY, Counter, Histogram

        r = registry if registry is not None else REGISTRY
        self.registry = r
        self.runs = Counter("orchestra_pipeline_runs", "Pipeline runs finished, by outcome", ["pipeline", "status"],
                            registry=r)
        self.run_seconds = Histogram("orchestra_pipeline_run_seconds", "Pipeline run wall time", ["pipeline"],
                                     buckets=_RUN_BUCKETS, registry=r)
        self.agents = Counter("orchestra_pipeline_agents", "Agents finished, by status", ["pipeline", "status"],
                              registry=r)
        self.cache_paths = Counter("orchestra_pipeline_cache_paths", "The cache each agent ran on, by path",
                                   ["model_name", "path"], registry=r)
        self.fallbacks = Counter("orchestra_pipeline_fallbacks", "Mapped caches refused and re-prefilled, by gate",
                                 ["model_name", "reason"], registry=r)
        self.step_seconds = Counter("orchestra_pipeline_cache_step_seconds", "Seconds of FamilyCache steps",
                                    ["model_name", "step"], registry=r)
        self.prefill_seconds = Counter("orchestra_pipeline_prefill_seconds", "Document prefill seconds, spent and "
                                       "saved (estimated, versus re-prefilling for every agent)", ["kind"], registry=r)
        self.ttft = Histogram("orchestra_pipeline_agent_ttft_seconds", "Seconds from an agent's start to its first "
                              "token", ["model_name"], buckets=_TTFT_BUCKETS, registry=r)
        self.generated = Counter("orchestra_pipeline_generated_tokens", "Tokens the agents generated", ["model_name"],
                                 registry=r)

    @classmethod
    def own(cls) -> PipelineMetrics:
        """The series in a registry of their own (a batch job's textfile holds only them)."""
        _require_prometheus()
        from prometheus_client import CollectorRegistry

        return cls(CollectorRegistry())

    def sink(self, pipeline: str) -> RunMetricsSink:
        """An event sink (``on_event``) for one run of `pipeline`."""
        return RunMetricsSink(self, pipeline)

    def observe_report(self, pipeline: str, report: RunReport, status: str | None = None) -> None:
        """Count a finished run from its report (what `RunMetricsSink` does at ``run_finished``)."""
        outcome = status or ("succeeded" if all(a.status == "succeeded" for a in report.agents) else "failed")
        self.runs.labels(pipeline=pipeline, status=outcome).inc()
        self.run_seconds.labels(pipeline=pipeline).observe(report.seconds)
        self.prefill_seconds.labels(kind="spent").inc(max(0.0, report.prefill_s_spent))
        self.prefill_seconds.labels(kind="saved").inc(max(0.0, report.prefill_s_saved))
        for agent in report.agents:
            self.agents.labels(pipeline=pipeline, status=agent.status).inc()
            if agent.cache_path is not None:
                self.cache_paths.labels(model_name=agent.model, path=agent.cache_path).inc()
            if agent.cache_path == "reprefilled":
                self.fallbacks.labels(model_name=agent.model, reason=fallback_reason_label(agent.fallback_reason)).inc()
            if agent.tokens:
                self.generated.labels(model_name=agent.model).inc(agent.tokens)

    def write_textfile(self, path: str | Path) -> None:
        """The registry in the text exposition format, for node_exporter's textfile collector (temp + rename)."""
        from prometheus_client import write_to_textfile

        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(target), self.registry)


class RunMetricsSink:
    """Feeds one run's events into `PipelineMetrics` (an ``on_event`` callable; sync, cheap)."""

    def __init__(self, metrics: PipelineMetrics, pipeline: str) -> None:
        self.metrics, self.pipeline = metrics, pipeline
        self._started: dict[str, tuple[str, float]] = {}
        self.counted = False

    def __call__(self, event: Event) -> None:
        from orchestra.observability.events import AgentStarted, CacheStepEvent, RunFinished, TokenEvent

        if isinstance(event, CacheStepEvent):
            if event.step.seconds > 0:
                self.metrics.step_seconds.labels(model_name=event.step.member, step=event.step.step).inc(
                    event.step.seconds)
        elif isinstance(event, AgentStarted):
            self._started[event.agent] = (event.model, event.at)
        elif isinstance(event, TokenEvent):
            started = self._started.pop(event.agent, None)
            if started is not None:  # the agent's first token
                self.metrics.ttft.labels(model_name=started[0]).observe(max(0.0, event.at - started[1]))
        elif isinstance(event, RunFinished) and event.report is not None and not self.counted:
            self.metrics.observe_report(self.pipeline, event.report)
            self.counted = True

    def ended_without_report(self, status: str) -> None:
        """Count a run that ended with no report (cancelled, or failed before its agents ran)."""
        if not self.counted:
            self.metrics.runs.labels(pipeline=self.pipeline, status=status).inc()
            self.counted = True
