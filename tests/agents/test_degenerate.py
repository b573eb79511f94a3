from __future__ import annotations

import pytest

from agents.builtin import critic, key_facts, question_answerer
from agents.degenerate import DegeneracyPolicy, check_text, check_value, prompt_examples
from agents.spec import AgentSpec, OutputSpec


@pytest.mark.parametrize(("text", "reason"), [
    ("", "empty"),
    ("   \n\n\t ", "empty"),
    (" to the document" + "\n" * 40, "whitespace"),  # the distilled critic's reply in issue 14
    ("a" + " " * 60 + "b", "whitespace"),
    ("The licence is free.\nThe licence is free.\nThe licence is free.\nOther.", "repeated_line"),
    ("you must keep the notice " * 12, "repetition_loop"),
])
def test_degenerate_replies_are_named(text, reason):
    found = check_text(text)
    assert found is not None and found.reason == reason and found.detail


@pytest.mark.parametrize("text", [
    "March.",  # short answers are answers
    "You must give the recipients the Corresponding Source under the terms of this License.",
    "Summary:\n\n- point one\n- point two\n\nThe document is a software licence.",
    "The document does not say.",
])
def test_real_replies_pass(text):
    assert check_text(text, spec=question_answerer("What?")) is None


def test_format_example_and_prompt_echo():
    spec = key_facts().model_copy(update={"output": OutputSpec(
        kind="json", instructions='Reply like {"facts": ["first fact", "second fact"]}')})
    assert prompt_examples(spec) == ("first fact", "second fact")
    found = check_value({"facts": ["first fact", "second fact"]}, spec=spec)
    assert found is not None and found.reason == "format_example"
    assert check_value({"facts": ["The GPL is a copyleft licence.", "It is free."]}, spec=spec) is None
    echo = check_text("Check this text against the document.", spec=critic("summary"))
    assert echo is not None and echo.reason == "prompt_echo"
    # the upstream text inside the task is not the agent's own words: quoting it is no echo
    spec2 = AgentSpec(name="c", task="Repeat: {up}")
    assert check_text("a sentence that came from upstream, long enough", spec=spec2) is None


def test_json_values():
    assert check_value({"facts": ["", "  "]}).reason == "empty"
    assert check_value({"facts": ["same thing", "Same thing."]}).reason == "repeated_line"
    assert check_value({"facts": ["one", "two"]}) is None


def test_policy_thresholds_apply():
    text = "x\n" + "\n" * 5 + "y"
    assert check_text(text) is None
    assert check_text(text, policy=DegeneracyPolicy(max_blank_lines=3)).reason == "whitespace"


def test_numbered_list_of_one_repeated_item_is_a_loop():
    text = ("1. The document starts with a sentence.\n2. It is written clearly.\n3. It is written clearly.\n"
            "4. It is written clearly.")  # SmolLM2-135M's reply before repetition control
    assert check_text(text).reason == "repeated_line"
