from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError

from agents import BUILTINS, UnknownUpstreamError
from agents.builtin import KeyFacts, critic, key_facts, question_answerer, report_writer, summarizer
from mappings.repair import RepairPolicy


def test_builtins_render_with_their_inputs():
    assert summarizer().required_inputs() == ()
    assert "in 80 words or fewer" in summarizer(max_words=80).render_task()
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
    assert "Notes from key_facts:\n{\"facts\":[\"F\"]}" in text and "Notes from summarizer:\nS" in text
    # no literal reply or format example for a small model to parrot (issue 14)
    assert "first fact" not in facts.output.format_instructions() and facts.output.grounded
    assert "exactly" not in qa.render_task() and "exactly" not in check.render_task({"summarizer": "S"})
    with pytest.raises(UnknownUpstreamError):
        report.render_task({"summarizer": "S"})


def test_the_question_answerer_is_the_wording_its_benchmark_chose():
    """The wording measured best against the plain prompt (results/qa_prompt_variants.md, brief): no role, the
    question then a brief-answer instruction, no repetition penalty, a 6-token n-gram ban."""
    qa = question_answerer("Who may copy it?")
    assert qa.role == ""
    assert qa.render_task() == "Question: Who may copy it?\nAnswer briefly."
    assert qa.generation.repetition_penalty == 1.0 and qa.generation.no_repeat_ngram_size == 6
    assert qa.generation.stop == ("\n\n", "\nQuestion:")
    assert question_answerer("Who?", search=True).generation.stop == ("\nQuestion:",)


def test_the_question_answerer_asks_for_the_repair_its_benchmark_chose():
    """On a mapped cache it asks for a quarter of a prefill, half on interior tokens (results/qa_repair_curve.md:
    the cheapest setting at least as accurate as the member's own prefill); other built-ins ask for none."""
    assert question_answerer("Who?").mapped_repair == RepairPolicy(budget=0.25, scattered_share=0.5)
    assert summarizer().mapped_repair is None


def test_builtin_arguments_are_checked():
    with pytest.raises(ValueError):
        question_answerer("  ")
    with pytest.raises(ValueError):
        report_writer([])
    with pytest.raises(ValueError):
        critic("not a name")
    assert set(BUILTINS) == {"summarizer", "key_facts", "question_answerer", "critic", "report_writer"}


def test_registry_is_explicit_and_read_only():
    import agents
    import agents.builtin as module

    assert "BUILTINS" in agents.__all__ and agents.BUILTINS is BUILTINS
    assert list(BUILTINS) == ["summarizer", "key_facts", "question_answerer", "critic", "report_writer"]
    assert all(BUILTINS[name].__name__ == name for name in BUILTINS)
    # helpers of the module are not built-ins, whatever getattr would find
    assert hasattr(module, "KeyFacts") and "KeyFacts" not in BUILTINS and "Field" not in BUILTINS
    with pytest.raises(TypeError):
        BUILTINS["mine"] = summarizer  # type: ignore[index]


def test_factories_validate_their_arguments_by_name():
    with pytest.raises(ValidationError) as err:
        summarizer(max_wordz=80)
    assert err.value.errors()[0]["type"] == "unexpected_keyword_argument" and err.value.errors()[0]["loc"] == ("max_wordz",)
    with pytest.raises(ValidationError) as err:
        question_answerer()
    assert err.value.errors()[0]["type"] == "missing_argument" and err.value.errors()[0]["loc"] == ("question",)
    for bad in (-5, 0, 10**8):
        with pytest.raises(ValidationError, match="from 1 to 32768"):
            key_facts(max_new_tokens=bad)
    with pytest.raises(ValidationError):
        summarizer(max_words="many")
    with pytest.raises(ValidationError):
        report_writer("summary")  # a string is not a list of names
    with pytest.raises(ValidationError):
        key_facts(max_repairs=9)
    assert list(inspect.signature(critic).parameters) == ["target_agent", "name", "max_new_tokens"]
    assert critic("summary", max_new_tokens=24).generation.max_new_tokens == 24
