"""The run report's lookups: an agent by name, or a typed error naming the agents it has."""

from __future__ import annotations

import pytest

from orchestra import OrchestraError, UnknownAgentError
from orchestra.observability.report import AgentReport, RunReport


def _report(*names: str) -> RunReport:
    agents = [AgentReport(name=name, model="root", status="succeeded", output=name.upper()) for name in names]
    return RunReport(run_id="r1", pipeline="brief", source_model="root", document_tokens=10, agents=agents, caches=[],
                     seconds=1.0, prefill_s_spent=0.5, prefill_s_saved=0.0, store_hits=0, store_misses=1,
                     store_hit_rate=0.0)


def test_agent_returns_the_named_agents_report():
    report = _report("summarizer", "key_facts")
    assert report.agent("key_facts").output == "KEY_FACTS"


def test_unknown_agent_is_a_typed_error_naming_the_agents_the_report_has():
    report = _report("summarizer", "summarizer_critic", "key_facts")
    with pytest.raises(UnknownAgentError) as err:
        report.agent("critic")
    assert str(err.value) == "no agent 'critic' in this report: it has summarizer, summarizer_critic, key_facts"
    assert isinstance(err.value, OrchestraError)  # the CLI's one-line error path catches it
    assert not isinstance(err.value, StopIteration)  # it was a bare StopIteration (which generators swallow)


def test_unknown_agent_suggests_a_close_name_and_an_empty_report_says_so():
    with pytest.raises(UnknownAgentError, match=r"^no agent 'sumarizer' in this report \(did you mean 'summarizer'\?\): "
                                                r"it has summarizer, key_facts$"):
        _report("summarizer", "key_facts").agent("sumarizer")
    with pytest.raises(UnknownAgentError, match=r"^no agent 'a' in this report: it has no agents$"):
        _report().agent("a")
