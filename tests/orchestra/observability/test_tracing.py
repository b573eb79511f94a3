"""OpenTelemetry spans of a run, from its events, into the SDK's in-memory exporter."""

from __future__ import annotations

import subprocess
import sys

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestra import Pipeline
from orchestra.family.corpus import data_text
from orchestra.observability.tracing import RunTracer, run_tracer
from tests.waiting import HANG_GUARD_S

DOC = data_text("gpl-3.txt")[:300]


def test_a_run_is_a_tree_of_spans_with_its_cache_steps_gates_and_steps(fam, mapstore):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    pipeline = (Pipeline("traced", source="base", models={"base": str(fam.parent), "child": str(fam.child)},
                         mapping={"directory": str(mapstore.directory), "on_missing": "calibrate"},
                         default_device="cpu")
                .step(lambda document: len(document), name="length")
                .agent({"name": "a", "task": "Summarise.", "generation": {"max_new_tokens": 3}}, model="base")
                .agent({"name": "b", "task": "Check {a}", "generation": {"max_new_tokens": 3}}, model="child"))
    report = pipeline.run_sync(DOC, on_event=RunTracer(provider.get_tracer("test")))
    pipeline.close()
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (run,) = by_name["orchestra.run"]
    assert run.attributes["orchestra.run.id"] == report.run_id and run.parent is None
    agents = {s.attributes["orchestra.agent"]: s for s in by_name["orchestra.agent"]}
    assert set(agents) == {"a", "b", "length"} and all(s.parent.span_id == run.context.span_id for s in agents.values())
    assert agents["b"].attributes["gen_ai.request.model"] == "child"
    assert agents["length"].attributes["gen_ai.operation.name"] == "execute_step"
    mapped = by_name["orchestra.cache.map"][0]
    assert mapped.parent.span_id == agents["b"].context.span_id and mapped.attributes["orchestra.source_model"] == "base"
    gates = by_name["orchestra.gate"]
    assert {g.parent.span_id for g in gates} == {agents["b"].context.span_id}
    assert all(isinstance(g.attributes["orchestra.gate.passed"], bool) for g in gates)
    assert run.attributes["orchestra.prefill_s_spent"] == report.prefill_s_spent
    assert all(s.end_time >= s.start_time for s in spans)


def test_tracing_is_off_without_a_provider_and_on_with_the_otlp_variable():
    assert run_tracer() is None  # the API's default provider: no spans are made
    code = ("import os; os.environ['OTEL_EXPORTER_OTLP_ENDPOINT'] = 'http://127.0.0.1:9'; "
            "from orchestra.observability.tracing import configure_from_env, run_tracer; "
            "print(configure_from_env(), run_tracer() is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
