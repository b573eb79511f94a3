from __future__ import annotations

import copy

import pytest

from agents import AgentSpec, DocumentPrompt, EmptyDocumentError, build_suffix, suffix_ids
from agents.builtin import critic, key_facts, question_answerer, report_writer, summarizer
from agents.prompt import DEFAULT_PREAMBLE, RepairTurn
from tests.agents.conftest import CHATML_TEMPLATE, DOCUMENT
from tests.tiny_family import make_tokenizer

UPSTREAM = {"summarizer": "A summary.", "key_facts": '{"facts": ["x"]}'}
SPECS = [summarizer(), key_facts(), question_answerer("What grew?"), critic("summarizer"),
         report_writer(["summarizer", "key_facts"])]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def test_prefix_is_model_independent_text_ending_at_newline():
    doc = DocumentPrompt("\n  Body text.  \n\n")
    assert doc.text.startswith(DEFAULT_PREAMBLE)
    assert doc.text.endswith("\n") and "Body text.\n=== DOCUMENT END ===" in doc.text
    with pytest.raises(EmptyDocumentError):
        DocumentPrompt(" \n\t ")


def test_prefix_ids_identical_across_agents_and_family_members(tiny):
    doc = DocumentPrompt(DOCUMENT)
    ids = doc.token_ids(tiny.tokenizer)
    assert ids == doc.token_ids(tiny.child_tokenizer)
    for spec in SPECS:
        full_parent = ids + suffix_ids(tiny.tokenizer, spec, UPSTREAM)
        full_child = ids + suffix_ids(tiny.child_tokenizer, spec, UPSTREAM)
        assert full_parent[: len(ids)] == ids and full_parent == full_child


@pytest.mark.parametrize("chat", [False, True])
def test_concatenated_ids_decode_to_the_intended_text(tokenizer, chat_tokenizer, chat):
    tok = chat_tokenizer if chat else tokenizer
    doc = DocumentPrompt(DOCUMENT)
    for spec in SPECS:
        suffix = build_suffix(tok, spec, UPSTREAM)
        assert suffix.chat_template is chat
        decoded = tok.decode(doc.token_ids(tok) + list(suffix.ids), skip_special_tokens=False)
        assert decoded == doc.text + suffix.text
        assert spec.render_task(UPSTREAM).strip() in suffix.text
        if chat:
            assert suffix.text.startswith("<|im_start|>system\n" + spec.role)
            assert suffix.text.endswith("<|im_start|>assistant\n")
        else:
            assert suffix.text.startswith("\n### Instructions\n" + spec.role)
            assert suffix.text.endswith("### Response\n")


def test_json_agents_get_format_instructions_and_repair_turns(chat_tokenizer, tokenizer):
    spec = key_facts()
    turn = RepairTurn(previous_output='{"facts": []}', instruction="Fix it.")
    for tok in (tokenizer, chat_tokenizer):
        plain = build_suffix(tok, spec)
        repaired = build_suffix(tok, spec, repairs=[turn])
        assert spec.output.format_instructions() in plain.text
        assert repaired.text.startswith(plain.text[: len(plain.text) - 30])
        assert '{"facts": []}' in repaired.text and "Fix it." in repaired.text
    chat = build_suffix(chat_tokenizer, spec, repairs=[turn]).text
    assert "<|im_start|>assistant\n{\"facts\": []}<|im_end|>" in chat


def test_use_chat_template_can_be_forced_off(chat_tokenizer):
    assert not build_suffix(chat_tokenizer, summarizer(), use_chat_template=False).chat_template


def test_document_cannot_inject_special_tokens(tokenizer):
    eos = tokenizer.eos_token  # "</s>"
    doc = DocumentPrompt(f"before {eos} after")
    ids = doc.token_ids(tokenizer)
    assert tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == doc.text


def test_bos_once_at_the_start_and_never_in_the_suffix():
    from tokenizers import processors

    tok = make_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    tok.chat_template = "{{ bos_token }}" + CHATML_TEMPLATE
    doc = DocumentPrompt(DOCUMENT)
    ids = doc.token_ids(tok)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    suffix = build_suffix(tok, summarizer())
    assert tok.bos_token_id not in suffix.ids and not suffix.text.startswith("<s>")


def test_system_role_falls_back_into_the_user_turn(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    spec = AgentSpec(name="a", role="Be terse.", task="Summarize.")
    text = build_suffix(tok, spec).text
    assert text == "[user] Be terse.\n\nSummarize.\n[assistant] "
