"""continue_ids on the tiny models: exact over a cached prefix, stop strings, cancellation, locking."""

from __future__ import annotations

import threading

import pytest
import torch

from agents import (
    ContextOverflowError,
    DocumentPrompt,
    PrefixCacheMismatchError,
    cache_length,
    continue_ids,
    prefill_document,
)
from agents.kv import cache_tensors
from tests.agents.conftest import DOCUMENT

QUESTION = "\nQuestion: what did the board approve?\nAnswer:"


def _prompt(tokenizer) -> tuple[list[int], list[int]]:
    prefix = DocumentPrompt(DOCUMENT).token_ids(tokenizer)
    return prefix, list(tokenizer(QUESTION, add_special_tokens=False)["input_ids"])


def test_greedy_over_a_prefix_cache_equals_feeding_everything_and_leaves_the_cache_untouched(tiny):
    prefix, new = _prompt(tiny.tokenizer)
    prefill = prefill_document(tiny.model, prefix)
    before = [(k.clone(), v.clone()) for k, v in cache_tensors(prefill.cache)]
    streamed: list[tuple[str, int, int]] = []
    cached = continue_ids(tiny.model, tiny.tokenizer, prefill.cache, len(prefix), new, max_new_tokens=12,
                          on_token=lambda *event: streamed.append(event))
    scratch = continue_ids(tiny.model, tiny.tokenizer, None, 0, prefix + new, max_new_tokens=12)
    assert cached.token_ids == scratch.token_ids and cached.text == scratch.text
    assert cached.finish_reason == scratch.finish_reason in {"eos", "length"}
    assert cached.prompt_tokens == len(new) and scratch.prompt_tokens == len(prefix) + len(new)
    assert cached.prompt_s > 0 and cached.generation_s >= 0
    # every token is reported once, in order, and the streamed pieces are the text
    assert [t for _, t, _ in streamed] == cached.token_ids
    assert [i for _, _, i in streamed] == list(range(len(cached.token_ids)))
    assert "".join(text for text, _, _ in streamed) == cached.text
    # the given cache still holds exactly the prefix, bit for bit
    assert cache_length(prefill.cache) == len(prefix)
    for (k0, v0), (k1, v1) in zip(before, cache_tensors(prefill.cache), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_stop_strings_cut_the_text(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    prefix, new = _prompt(tok)
    prefill = prefill_document(model, prefix)
    free = continue_ids(model, tok, prefill.cache, len(prefix), new, max_new_tokens=24)
    stop = free.text[5:8]  # something the model says anyway
    assert len(stop) == 3
    streamed: list[str] = []
    cut = continue_ids(model, tok, prefill.cache, len(prefix), new, max_new_tokens=24, stop=[stop],
                       on_token=lambda text, *_: streamed.append(text))
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop)]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 24
    assert "".join(streamed) == cut.text  # a partial stop string is never streamed


def test_cancel_between_tokens_returns_what_was_streamed(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    prefix, new = _prompt(tok)
    prefill = prefill_document(model, prefix)
    streamed: list[str] = []
    out = continue_ids(model, tok, prefill.cache, len(prefix), new, max_new_tokens=50,
                       on_token=lambda text, *_: streamed.append(text), cancel=lambda: len(streamed) >= 3)
    assert out.finish_reason == "cancelled" and len(out.token_ids) == 3 and out.text == "".join(streamed)

    stop = threading.Event()
    stop.set()
    early = continue_ids(model, tok, prefill.cache, len(prefix), new, max_new_tokens=50, cancel=stop)
    assert early.finish_reason == "cancelled" and early.token_ids == [] and early.text == ""


def test_the_lock_is_held_around_every_forward_pass(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    prefix, new = _prompt(tok)
    prefill = prefill_document(model, prefix)
    lock = threading.Lock()
    passes: list[bool] = []
    hook = model.register_forward_pre_hook(lambda module, args: passes.append(lock.locked()))
    try:
        out = continue_ids(model, tok, prefill.cache, len(prefix), new, max_new_tokens=5, lock=lock)
    finally:
        hook.remove()
    assert passes == [True] * len(out.token_ids)  # the prompt, then one pass per token but the last
    assert not lock.locked()


def test_bad_arguments_fail_before_any_compute(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    prefix, new = _prompt(tok)
    prefill = prefill_document(model, prefix)
    with pytest.raises(PrefixCacheMismatchError):
        continue_ids(model, tok, prefill.cache, len(prefix) - 1, new, max_new_tokens=4)
    with pytest.raises(ValueError, match="new_ids is empty"):
        continue_ids(model, tok, prefill.cache, len(prefix), [], max_new_tokens=4)
    with pytest.raises(ContextOverflowError):
        continue_ids(model, tok, prefill.cache, len(prefix), new, max_new_tokens=10_000)
