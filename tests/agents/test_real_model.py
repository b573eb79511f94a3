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


def test_chat_template_suffix_and_stable_prefix(smol):
    _, tok = smol
    doc = DocumentPrompt(DOCUMENT)
    ids = doc.token_ids(tok)
    assert ids == DocumentPrompt(DOCUMENT).token_ids(tok)
    assert tok.decode(ids) == doc.text
    for spec in (summarizer(), key_facts(), question_answerer("When will the library open?"), critic("summarizer")):
        suffix = build_suffix(tok, spec, {"summarizer": "The library opens in March."})
        assert suffix.chat_template
        assert suffix.text.startswith("<|im_start|>system\n") and suffix.text.endswith("<|im_start|>assistant\n")
        assert tok.decode(ids + list(suffix.ids)) == doc.text + suffix.text


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
