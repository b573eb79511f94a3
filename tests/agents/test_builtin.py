from __future__ import annotations

import pytest

from agents import BUILTINS, UnknownUpstreamError
from agents.builtin import KeyFacts, critic, key_facts, question_answerer, report_writer, summarizer


def test_builtins_render_with_their_inputs():
    assert summarizer().required_inputs() == ()
    assert "at most 80 words" in summarizer(max_words=80).render_task()
    facts = key_facts(max_facts=5)
    assert facts.output.kind == "json" and facts.output.model is KeyFacts and facts.output.max_repairs == 2
    assert "5 most important facts" in facts.render_task()
    qa = question_answerer("What does {x} cost in $?")
    assert qa.required_inputs() == () and "Question: What does {x} cost in $?" in qa.render_task()
    check = critic("summarizer")
    assert check.name == "summarizer_critic" and check.required_inputs() == ("summarizer",)
    assert "The library opens in March." in check.render_task({"summarizer": "The library opens in March."})
    report = report_writer(["summarizer", "key_facts", "summarizer_critic", "summarizer"])
    assert report.required_inputs() == ("summarizer", "key_facts", "summarizer_critic")
    text = report.render_task({"summarizer": "S", "key_facts": KeyFacts(facts=["F"]), "summarizer_critic": "C"})
    assert "### Notes from key_facts\n{\"facts\":[\"F\"]}" in text and "### Notes from summarizer\nS" in text
    with pytest.raises(UnknownUpstreamError):
        report.render_task({"summarizer": "S"})


def test_builtin_arguments_are_checked():
    with pytest.raises(ValueError):
        question_answerer("  ")
    with pytest.raises(ValueError):
        report_writer([])
    with pytest.raises(ValueError):
        critic("not a name")
    assert set(BUILTINS) == {"summarizer", "key_facts", "question_answerer", "critic", "report_writer"}
