"""Pipeline metrics from a run's events: what each series counts, and the textfile a batch job writes."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry  # noqa: E402

from orchestra.familycache import CacheStep  # noqa: E402
from orchestra.observability.events import AgentStarted, CacheStepEvent, RunFinished, TokenEvent  # noqa: E402
from orchestra.observability.metrics import PipelineMetrics, fallback_reason_label  # noqa: E402
from orchestra.observability.report import AgentReport, RunReport  # noqa: E402


def _report() -> RunReport:
    agents = [AgentReport(name="a", model="root", status="succeeded", cache_path="exact", tokens=5),
              AgentReport(name="b", model="finetuned", status="succeeded", cache_path="reprefilled", tokens=3,
                          fallback_reason="probe gate failed: probe KL to the source rose by 0.3 > 0.1"),
              AgentReport(name="c", model="finetuned", status="failed", cache_path="mapped")]
    return RunReport(run_id="r1", pipeline="demo", source_model="root", document_tokens=100, agents=agents, caches=[],
                     seconds=12.0, prefill_s_spent=2.0, prefill_s_saved=5.0, store_hits=1, store_misses=1,
                     store_hit_rate=0.5)


def test_a_runs_events_fill_every_series():
    registry = CollectorRegistry()
    sink = PipelineMetrics(registry).sink("demo")
    sink(AgentStarted(run_id="r1", agent="a", model="root", at=100.0))
    sink(TokenEvent(run_id="r1", agent="a", text="x", index=0, at=100.75))
    sink(TokenEvent(run_id="r1", agent="a", text="y", index=1, at=101.0))  # not a first token: not observed
    sink(CacheStepEvent(run_id="r1", agent="b", step=CacheStep(step="map", member="finetuned", tokens=100, seconds=0.5)))
    sink(RunFinished(run_id="r1", succeeded=["a", "b"], failed=["c"], skipped=[], seconds=12.0, report=_report()))
    sink(RunFinished(run_id="r1", succeeded=[], failed=[], skipped=[], seconds=1.0, report=_report()))  # counted once

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("orchestra_pipeline_runs_total", pipeline="demo", status="failed") == 1
    assert value("orchestra_pipeline_run_seconds_sum", pipeline="demo") == 12.0
    assert value("orchestra_pipeline_agents_total", pipeline="demo", status="succeeded") == 2
    assert value("orchestra_pipeline_agents_total", pipeline="demo", status="failed") == 1
    assert value("orchestra_pipeline_cache_paths_total", model_name="finetuned", path="reprefilled") == 1
    assert value("orchestra_pipeline_cache_paths_total", model_name="root", path="exact") == 1
    assert value("orchestra_pipeline_fallbacks_total", model_name="finetuned", reason="probe") == 1
    assert value("orchestra_pipeline_cache_step_seconds_total", model_name="finetuned", step="map") == 0.5
    assert value("orchestra_pipeline_prefill_seconds_total", kind="saved") == 5.0
    assert value("orchestra_pipeline_prefill_seconds_total", kind="spent") == 2.0
    assert value("orchestra_pipeline_agent_ttft_seconds_count", model_name="root") == 1
    assert value("orchestra_pipeline_agent_ttft_seconds_sum", model_name="root") == 0.75
    assert value("orchestra_pipeline_generated_tokens_total", model_name="finetuned") == 3


def test_a_run_with_no_report_is_counted_once_by_how_it_ended():
    registry = CollectorRegistry()
    sink = PipelineMetrics(registry).sink("demo")
    sink.ended_without_report("cancelled")
    sink.ended_without_report("failed")
    assert registry.get_sample_value("orchestra_pipeline_runs_total", {"pipeline": "demo", "status": "cancelled"}) == 1
    assert registry.get_sample_value("orchestra_pipeline_runs_total", {"pipeline": "demo", "status": "failed"}) is None


@pytest.mark.parametrize(("reason", "label"), [
    ("probe gate failed: probe KL to the source rose by 0.266 > 0.1", "probe"),
    ("offline gate: layer 3 relative error 0.4 > 0.2", "offline"),
    ("the mapping is stale", "other"), (None, "other")])
def test_fallback_reasons_become_a_bounded_label(reason, label):
    assert fallback_reason_label(reason) == label


def test_the_textfile_for_node_exporter_is_the_exposition_format(tmp_path):
    metrics = PipelineMetrics(CollectorRegistry())
    metrics.observe_report("demo", _report())
    target = tmp_path / "textfile" / "orchestra.prom"
    metrics.write_textfile(target)
    text = target.read_text()
    assert '# TYPE orchestra_pipeline_runs_total counter' in text
    assert 'orchestra_pipeline_runs_total{pipeline="demo",status="failed"} 1.0' in text
    assert [p.name for p in target.parent.iterdir()] == ["orchestra.prom"]  # written beside, then renamed
