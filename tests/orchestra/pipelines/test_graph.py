from __future__ import annotations

import pytest

from orchestra.errors import CycleError, UnknownAgentError
from orchestra.pipelines.graph import build_graph, descendants, levels, to_mermaid
from orchestra.pipelines.spec import pipeline_mermaid


def test_levels_respect_dependencies():
    g = build_graph({"sum": [], "facts": [], "critic": ["sum"], "report": ["sum", "facts", "critic"]})
    assert levels(g) == [["facts", "sum"], ["critic"], ["report"]]
    assert descendants(g, ["sum"]) == {"critic", "report"}


def test_cycle_is_named():
    with pytest.raises(CycleError, match="a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c"):
        build_graph({"a": ["c"], "b": ["a"], "c": ["b"]})
    with pytest.raises(CycleError, match="itself"):
        build_graph({"a": ["a"]})


def test_unknown_upstream_lists_known_agents():
    with pytest.raises(UnknownAgentError, match="'summarizr'.*did you mean 'summarizer'.*known agents: critic, summarizer"):
        build_graph({"summarizer": [], "critic": ["summarizr"]})


def test_mermaid_has_every_agent_and_edge():
    g = build_graph({"sum": [], "critic": ["sum"]}, models={"sum": "root", "critic": "tuned"})
    text = to_mermaid(g, "root")
    assert text.startswith("flowchart TD")
    assert "doc --> a_sum" in text and "a_sum --> a_critic" in text and "tuned" in text


def test_pipeline_mermaid_labels_alias_and_member_and_uses_template_reads():
    from orchestra.pipelines.spec import PipelineSpec

    spec = PipelineSpec(models={"root": "root", "small": "distilled"}, agents=[
        {"name": "sum", "model": "root", "builtin": "summarizer"},
        {"name": "check", "model": "small", "builtin": "critic", "args": {"target_agent": "sum"}},  # no `upstream`
    ])
    text = pipeline_mermaid(spec)
    assert text.startswith("flowchart TD") and 'document prefill on root' in text
    assert "small: distilled" in text and "a_sum --> a_check" in text and "doc --> a_check" not in text
