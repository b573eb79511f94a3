"""SmolLM2-135M-Instruct (chat template path): stable prefix ids, cache reuse exactness, a real summary."""

from __future__ import annotations

import pytest

from agents import DocumentPrompt, build_suffix, generate, prefill_document
from agents.builtin import critic, key_facts, question_answerer, summarizer

pytestmark = pytest.mark.real_model

DOCUMENT = (
    "The city council of Lakeside met on Tuesday to discuss the new library. The building will open in "
    "March and will hold forty thousand books. It was paid for by a local bank and by the state. The mayor "
    "said the library will stay open until nine in the evening on weekdays. Two council members voted "
    "against the plan because of the cost of the parking garage."
)


@pytest.fixture(scope="module")
def smol(smollm_root):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_root)
    model = AutoModelForCausalLM.from_pretrained(smollm_root, dtype=torch.float32).eval()
    return model, tok


def test_chat_native_prefix_identical_for_every_agent_and_member(smol, real_family):
    from transformers import AutoTokenizer

    from agents.prompt import SYSTEM_MESSAGE, chat_native

    _, tok = smol
    doc = DocumentPrompt(DOCUMENT)
    ids = doc.token_ids(tok)
    assert chat_native(tok)
    text = doc.text_for(tok)
    # the document sits inside the first user turn, after our system message (not SmolLM2's default one)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM_MESSAGE}<|im_end|>\n<|im_start|>user\n")
    assert "SmolLM" not in text and tok.decode(ids) == text
    for role in ("root", "finetuned", "quantized", "distilled"):
        member_tok = AutoTokenizer.from_pretrained(real_family.member_path(role))
        assert DocumentPrompt(DOCUMENT).token_ids(member_tok) == ids, role
    for spec in (summarizer(), key_facts(), question_answerer("When will the library open?"), critic("summarizer")):
        suffix = build_suffix(tok, spec, {"summarizer": "The library opens in March."})
        assert suffix.chat_template and suffix.text.startswith("\n" + spec.role)
        assert suffix.text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert tok.decode(ids + list(suffix.ids)) == text + suffix.text


def test_summary_over_the_shared_cache_matches_reprefill(smol):
    model, tok = smol
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    prefill = prefill_document(model, ids)
    spec = summarizer(max_new_tokens=12)
    cached = generate(model, tok, spec, prefix_ids=ids, prefix_cache=prefill.cache)
    assert cached.text.strip() and cached.finish_reason in {"eos", "length"}
    baseline = generate(model, tok, spec, prefix_ids=ids)
    assert cached.token_ids == baseline.token_ids
    # the cached run prefilled only its suffix over the shared cache; the baseline the whole prompt
    assert not cached.reprefilled and baseline.reprefilled


def test_grounded_key_facts_over_the_shared_cache_match_reprefill(smol):
    model, tok = smol
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    prefill = prefill_document(model, ids)
    spec = key_facts(max_facts=2, max_new_tokens=48, max_repairs=0, grounded=False)
    cached = generate(model, tok, spec, prefix_ids=ids, prefix_cache=prefill.cache)
    baseline = generate(model, tok, spec, prefix_ids=ids)
    assert cached.constrained and cached.token_ids == baseline.token_ids
    assert cached.text.startswith('{\n  "facts": [')  # grammar-constrained: well-formed by construction
