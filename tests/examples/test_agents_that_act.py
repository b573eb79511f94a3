"""examples/agents_that_act on the real family: Python steps, a tool-using agent, a routed branch, one prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestra import Pipeline
from orchestra.pipelines.spec import load_pipeline, pipeline_mermaid

PIPELINE = Path(__file__).resolve().parents[2] / "examples/agents_that_act/pipeline.yaml"


def test_the_example_loads_its_steps_from_its_own_folder_and_draws_them():
    spec = load_pipeline(PIPELINE)
    assert [s.call for s in spec.steps] == ["checks:classify", "checks:sections"]
    assert spec.agent("lookup").agent_spec().tools[0].name == "find"
    assert spec.upstreams()["facts"] == ["kind"]  # the routed branch waits for what it tests
    drawn = pipeline_mermaid(spec)
    assert "step: checks:classify" in drawn and "a_kind --> a_facts" in drawn


@pytest.mark.real_model
def test_the_example_runs_steps_tools_and_routing_over_one_document_prefill(real_family, short_document_file):
    pipeline = Pipeline.from_file(PIPELINE).with_kv_store(False)
    report = pipeline.run_sync(short_document_file)
    pipeline.close()
    status = {a.name: a.status for a in report.agents}
    assert status["kind"] == status["outline"] == "succeeded" and report.agent("kind").output == "licence"
    assert status["lookup"] in ("succeeded", "degenerate") and 1 <= len(report.agent("lookup").tool_calls) <= 2
    assert status["facts"] != "skipped"  # a licence: the routed branch ran
    assert status["report"] == "succeeded"  # on whatever its upstreams gave
    assert [c.model for c in report.caches if c.path == "exact"] == ["root"]  # the document was prefilled once
