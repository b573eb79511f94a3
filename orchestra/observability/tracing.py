"""OpenTelemetry traces of pipeline runs, made from the run's typed events.

One span per run (``orchestra.run``), a child per agent or step (``orchestra.agent``), and under each agent
a span per cache step (``orchestra.cache.prefill`` / ``map`` / ``repair`` / ``load`` / ...), per gate
decision (``orchestra.gate``) and per tool call (``orchestra.tool``), with their member, tokens, seconds,
verdicts and reasons as attributes; a fallback is an event on its agent's span with the reason.
Attributes follow the OpenTelemetry GenAI conventions where one applies (``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.usage.output_tokens``, ``gen_ai.tool.name``).

Off unless configured: without the ``opentelemetry`` packages nothing is imported; with them, spans go to
the global tracer provider, a no-op until the application (or `configure_from_env`, which `orchestra run`
and `orchestra serve` call) sets one. ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) makes
them export over OTLP/HTTP (the ``tracing`` extra).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from orchestra.observability.events import Event

__all__ = ["RunTracer", "run_tracer", "configure_from_env"]

_NS = 1_000_000_000


def _ns(seconds: float) -> int:
    return int(seconds * _NS)


class RunTracer:
    """An event sink that turns one run's events into spans (spans end when their node's events say so)."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.run: Span | None = None
        self.agents: dict[str, Span] = {}

    def __call__(self, event: Event) -> None:
        handler = getattr(self, f"_on_{event.kind}", None)
        if handler is not None:
            handler(event)

    # -- the run --------------------------------------------------------------------------------------------------
    def _on_run_started(self, event: Event) -> None:
        self.run = self.tracer.start_span("orchestra.run", start_time=_ns(event.at), attributes={
            "orchestra.run.id": event.run_id, "orchestra.source_model": getattr(event, "source_model", ""),
            "orchestra.document_tokens": getattr(event, "document_tokens", 0),
            "orchestra.agents": list(getattr(event, "agents", []))})

    def _on_run_finished(self, event: Event) -> None:
        for name, span in list(self.agents.items()):  # anything still open ended with the run
            span.end(end_time=_ns(event.at))
            del self.agents[name]
        if self.run is None:
            return
        report = getattr(event, "report", None)
        if report is not None:
            self.run.set_attributes({"orchestra.prefill_s_spent": report.prefill_s_spent,
                                     "orchestra.prefill_s_saved": report.prefill_s_saved,
                                     "orchestra.store_hit_rate": report.store_hit_rate,
                                     "orchestra.disk_loads": report.disk_loads})
        failed = list(getattr(event, "failed", []))
        self.run.set_attributes({"orchestra.succeeded": list(getattr(event, "succeeded", [])),
                                 "orchestra.failed": failed, "orchestra.skipped": list(getattr(event, "skipped", []))})
        if failed:
            from opentelemetry.trace import Status, StatusCode

            self.run.set_status(Status(StatusCode.ERROR, f"agents failed: {', '.join(failed)}"))
        self.run.end(end_time=_ns(event.at))

    def _on_document_prefilled(self, event: Event) -> None:
        self._child(None, "orchestra.cache.document", event.at - getattr(event, "seconds", 0.0), event.at, {
            "gen_ai.request.model": getattr(event, "model", ""), "orchestra.tokens": getattr(event, "tokens", 0),
            "orchestra.store_hit": bool(getattr(event, "store_hit", False))})

    # -- agents and steps ---------------------------------------------------------------------------------------
    def _on_agent_started(self, event: Event) -> None:
        agent = getattr(event, "agent", "")
        model = getattr(event, "model", "")
        self.agents[agent] = self._start("orchestra.agent", event.at, {
            "orchestra.agent": agent, "gen_ai.request.model": model,
            "gen_ai.operation.name": "execute_step" if model == "step" else "chat"})

    def _on_agent_finished(self, event: Event) -> None:
        self._end(event, None)

    def _on_agent_degenerate(self, event: Event) -> None:
        self._end(event, f"degenerate: {getattr(event, 'reason', '')}")

    def _on_agent_failed(self, event: Event) -> None:
        self._end(event, f"{getattr(event, 'error_type', '')}: {getattr(event, 'error', '')}")

    def _on_agent_skipped(self, event: Event) -> None:
        span = self._start("orchestra.agent", event.at, {"orchestra.agent": getattr(event, "agent", ""),
                                                          "orchestra.skipped": getattr(event, "reason", "")})
        span.end(end_time=_ns(event.at))

    def _on_agent_restored(self, event: Event) -> None:
        span = self._start("orchestra.agent", event.at, {"orchestra.agent": getattr(event, "agent", ""),
                                                          "orchestra.restored": getattr(event, "status", "")})
        span.end(end_time=_ns(event.at))

    # -- what happened inside an agent ----------------------------------------------------------------------
    def _on_cache_step(self, event: Event) -> None:
        step = getattr(event, "step", None)
        if step is None:
            return
        attributes: dict[str, object] = {"gen_ai.request.model": step.member, "orchestra.tokens": step.tokens,
                                         "orchestra.reused_tokens": step.reused_tokens,
                                         "orchestra.seconds": step.seconds}
        if step.source:
            attributes["orchestra.source_model"] = step.source
        if step.reason:
            attributes["orchestra.reason"] = step.reason
        self._child(getattr(event, "agent", None), f"orchestra.cache.{step.step}", event.at - step.seconds, event.at,
                    attributes)

    def _on_gate(self, event: Event) -> None:
        metrics = {f"orchestra.gate.{k}": float(v) for k, v in (getattr(event, "metrics", {}) or {}).items()
                   if isinstance(v, (int, float))}
        self._child(getattr(event, "agent", None), "orchestra.gate", event.at, event.at, {
            "gen_ai.request.model": getattr(event, "model", ""), "orchestra.gate.passed": bool(event.passed),  # type: ignore[attr-defined]
            "orchestra.reason": getattr(event, "reason", ""), **metrics})

    def _on_fallback(self, event: Event) -> None:
        span = self.agents.get(getattr(event, "agent", ""))
        if span is not None:
            span.add_event("orchestra.fallback", {"orchestra.reason": getattr(event, "reason", "")},
                           timestamp=_ns(event.at))
            span.set_attribute("orchestra.cache_path", "reprefilled")

    def _on_tool_result(self, event: Event) -> None:
        seconds = float(getattr(event, "seconds", 0.0))
        self._child(getattr(event, "agent", None), "orchestra.tool", event.at - seconds, event.at, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": getattr(event, "tool", ""),
            "orchestra.tool.ok": bool(getattr(event, "ok", False)), "orchestra.tool.round": getattr(event, "round", 0)})

    # -- helpers ------------------------------------------------------------------------------------------------
    def _start(self, name: str, at: float, attributes: dict[str, object], parent: Span | None = None) -> Span:
        from opentelemetry import trace

        base = parent if parent is not None else self.run
        context = trace.set_span_in_context(base) if base is not None else None
        return self.tracer.start_span(name, context=context, start_time=_ns(at), attributes=attributes)  # type: ignore[arg-type]

    def _child(self, agent: str | None, name: str, start: float, end: float, attributes: dict[str, object]) -> None:
        parent = self.agents.get(agent or "")
        span = self._start(name, start, attributes, parent)
        span.end(end_time=_ns(max(start, end)))

    def _end(self, event: Event, error: str | None) -> None:
        span = self.agents.pop(getattr(event, "agent", ""), None)
        if span is None:
            return
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        report_output = getattr(event, "output", None)
        if isinstance(report_output, str):
            span.set_attribute("orchestra.output_chars", len(report_output))
        span.end(end_time=_ns(event.at))


def run_tracer() -> RunTracer | None:
    """A tracer sink for one run, or None when OpenTelemetry is not installed (then tracing costs nothing)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    if isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None  # no provider configured: spans would go nowhere, so none are made
    return RunTracer(trace.get_tracer("orchestra"))


def configure_from_env() -> bool:
    """Export spans over OTLP/HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces one) is set; True if it
    set a provider. Needs the ``tracing`` extra; without the variables nothing happens."""
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        from orchestra.errors import OrchestraError, install_command

        raise OrchestraError("OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not installed: "
                             f"{install_command('tracing')}") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                                         "orchestra")}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True

