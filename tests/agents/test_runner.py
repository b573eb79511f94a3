"""Running agents on the tiny models: exactness of cache reuse, sampling, stops, errors."""

from __future__ import annotations

import pytest
import torch

from agents import (
    AgentSpec,
    ContextOverflowError,
    DocumentPrompt,
    GenerationCancelledError,
    GenerationSettings,
    PrefixCacheMismatchError,
    TokenEvent,
    UnknownUpstreamError,
    cache_length,
    generate,
    prefill_document,
)
from agents.kv import cache_tensors, copy_cache, forward_cache_kwarg
from tests.agents.conftest import DOCUMENT


def _spec(**generation) -> AgentSpec:
    settings = {"max_new_tokens": 12, **generation}
    return AgentSpec(name="writer", role="Write about the report.", task="Continue: the committee",
                     generation=GenerationSettings(**settings))


@pytest.fixture(scope="module")
def document_cache(tiny):
    ids = DocumentPrompt(DOCUMENT).token_ids(tiny.tokenizer)
    return ids, prefill_document(tiny.model, ids)


def test_greedy_over_copied_cache_equals_full_reprefill_and_leaves_cache_untouched(tiny, document_cache):
    ids, prefill = document_cache
    assert cache_length(prefill.cache) == len(ids) == prefill.tokens and prefill.seconds > 0
    before = [(k.clone(), v.clone()) for k, v in cache_tensors(prefill.cache)]
    spec = _spec(max_new_tokens=16)
    cached = generate(tiny.model, tiny.tokenizer, spec, prefix_ids=ids, prefix_cache=prefill.cache)
    baseline = generate(tiny.model, tiny.tokenizer, spec, prefix_ids=ids, prefix_cache=None)
    assert cached.token_ids == baseline.token_ids and cached.text == baseline.text
    assert len(cached.token_ids) == 16 and cached.finish_reason == "length"
    assert not cached.reprefilled and baseline.reprefilled
    assert cached.prefix_tokens == len(ids) and cached.suffix_tokens > 0
    t = cached.timings
    assert 0 < t.time_to_first_token_s <= t.total_s and t.tokens_per_s > 0 and t.prefill_s > 0
    # the shared cache still holds exactly the document, bit for bit
    assert cache_length(prefill.cache) == len(ids)
    after = cache_tensors(prefill.cache)
    assert len(after) == len(before)
    for (k0, v0), (k1, v1) in zip(before, after, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_same_cache_serves_several_agents(tiny, document_cache):
    ids, prefill = document_cache
    first = generate(tiny.model, tiny.tokenizer, _spec(), prefix_ids=ids, prefix_cache=prefill.cache)
    other = AgentSpec(name="other", task="List what the board did.", generation=GenerationSettings(max_new_tokens=6))
    generate(tiny.model, tiny.tokenizer, other, prefix_ids=ids, prefix_cache=prefill.cache)
    again = generate(tiny.model, tiny.tokenizer, _spec(), prefix_ids=ids, prefix_cache=prefill.cache)
    assert again.token_ids == first.token_ids


def test_seeded_sampling_is_reproducible(llama_tiny):
    ids = DocumentPrompt(DOCUMENT).token_ids(llama_tiny.tokenizer)
    prefill = prefill_document(llama_tiny.model, ids)
    runs = [
        generate(llama_tiny.model, llama_tiny.tokenizer, _spec(temperature=1.5, top_p=0.95, top_k=50, seed=seed),
                 prefix_ids=ids, prefix_cache=prefill.cache).token_ids
        for seed in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_stop_strings_cut_the_output(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    prefill = prefill_document(model, ids)
    free = generate(model, tok, _spec(max_new_tokens=24), prefix_ids=ids, prefix_cache=prefill.cache)
    # pick a stop string from the middle of what the model says anyway
    stop = free.text[5:8]
    assert len(stop) == 3 and free.text.find(stop) >= 0
    cut = generate(model, tok, _spec(max_new_tokens=24, stop=[stop]), prefix_ids=ids, prefix_cache=prefill.cache)
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 24


def test_a_text_reply_ends_where_it_writes_the_document_markers(llama_tiny, monkeypatch):
    import agents.runner as runner

    model, tok = llama_tiny.model, llama_tiny.tokenizer
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    prefill = prefill_document(model, ids)
    free = generate(model, tok, _spec(max_new_tokens=24), prefix_ids=ids, prefix_cache=prefill.cache)
    assert runner.FRAME_ECHOES == ("DOCUMENT START", "DOCUMENT END")
    # the random tiny model never writes the real markers: stand a piece of what it does write in for them
    marker = free.text[6:9]
    assert len(marker) == 3 and free.text.find(marker) >= 0
    monkeypatch.setattr(runner, "FRAME_ECHOES", (marker,))
    cut = generate(model, tok, _spec(max_new_tokens=24), prefix_ids=ids, prefix_cache=prefill.cache)
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(marker)].rstrip(" \t\n#=*-")
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 24


def test_eos_ends_generation(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    prefill = prefill_document(model, ids)
    first = generate(model, tok, _spec(max_new_tokens=4), prefix_ids=ids, prefix_cache=prefill.cache)
    # declare the model's second greedy token to be EOS: generation must stop right there
    original = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [original, first.token_ids[1]]
    try:
        out = generate(model, tok, _spec(max_new_tokens=4), prefix_ids=ids, prefix_cache=prefill.cache)
    finally:
        model.generation_config.eos_token_id = original
    assert out.finish_reason == "eos" and out.token_ids == first.token_ids[:2]


def test_token_callback_sees_every_token_and_the_text(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    prefill = prefill_document(model, ids)
    events: list[TokenEvent] = []
    out = generate(model, tok, _spec(), prefix_ids=ids, prefix_cache=prefill.cache, on_token=events.append)
    assert [e.token_id for e in events] == out.token_ids
    assert [e.index for e in events] == list(range(len(out.token_ids)))
    assert "".join(e.text for e in events) == out.text
    assert {e.agent for e in events} == {"writer"}


def test_cancellation_between_tokens(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    prefill = prefill_document(model, ids)
    seen: list[TokenEvent] = []
    with pytest.raises(GenerationCancelledError) as info:
        generate(model, tok, _spec(max_new_tokens=50), prefix_ids=ids, prefix_cache=prefill.cache,
                 on_token=seen.append, cancel=lambda: len(seen) >= 3)
    assert info.value.tokens_generated == 3 and len(seen) == 3


def test_unknown_upstream_fails_before_any_compute(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    spec = AgentSpec(name="critic", task="Check {summary}")
    with pytest.raises(UnknownUpstreamError, match="'summary'"):
        generate(model, tok, spec, prefix_ids=ids, prefix_cache=None, upstream={"facts": "x"})
    out = generate(model, tok, spec.with_generation(max_new_tokens=2), prefix_ids=ids, upstream={"summary": "x"})
    assert len(out.token_ids) == 2


def test_context_overflow_is_reported_with_the_excess(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    limit = model.config.max_position_embeddings  # 512 for the tiny models
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    prefill = prefill_document(model, ids)
    spec = _spec(max_new_tokens=limit)
    with pytest.raises(ContextOverflowError) as info:
        generate(model, tok, spec, prefix_ids=ids, prefix_cache=prefill.cache)
    err = info.value
    assert err.limit == limit and err.prefix_tokens == len(ids) and err.over_by == err.needed - limit > 0
    assert f"{err.over_by} more than" in str(err)
    long_doc = DocumentPrompt(DOCUMENT * 12).token_ids(tok)
    assert len(long_doc) > limit
    with pytest.raises(ContextOverflowError) as info:
        prefill_document(model, long_doc)
    assert info.value.over_by == len(long_doc) - limit


def test_prefix_cache_must_match_prefix_ids(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    prefill = prefill_document(model, ids[:-3])
    with pytest.raises(PrefixCacheMismatchError, match=f"{len(ids) - 3} tokens but the prefix has {len(ids)}"):
        generate(model, tok, _spec(), prefix_ids=ids, prefix_cache=prefill.cache)


def test_chunked_prefill_and_dtype_copy(llama_tiny):
    model, tok = llama_tiny.model, llama_tiny.tokenizer
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    whole = prefill_document(model, ids)
    chunked = prefill_document(model, ids, chunk_size=17)
    assert cache_length(chunked.cache) == len(ids)
    for (k0, v0), (k1, v1) in zip(cache_tensors(whole.cache), cache_tensors(chunked.cache), strict=True):
        torch.testing.assert_close(k0, k1, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v0, v1, atol=1e-4, rtol=1e-4)
    # a cache in another dtype is converted on copy; the original keeps its dtype
    f64 = torch.nn.Linear(2, 2).double()  # a model whose first floating-point parameter is float64
    converted = copy_cache(whole.cache, f64)
    assert cache_length(converted) == len(ids)
    assert all(k.dtype == v.dtype == torch.float64 for k, v in cache_tensors(converted))
    assert all(k.dtype == torch.float32 for k, _ in cache_tensors(whole.cache))


def test_forward_cache_kwarg_detects_old_and_new_names(llama_tiny):
    assert forward_cache_kwarg(llama_tiny.model) in {"cache", "past_key_values"}

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, position_ids=None, past_key_values=None, use_cache=None):
            raise NotImplementedError

    class New(torch.nn.Module):
        def forward(self, input_ids=None, position_ids=None, cache=None, use_cache=None):
            raise NotImplementedError

    assert forward_cache_kwarg(Old()) == "past_key_values"
    assert forward_cache_kwarg(New()) == "cache"


def test_copy_cache_of_a_legacy_list_cache():
    class Legacy:
        def __init__(self):
            self.key_cache = [torch.ones(1, 2, 3, 4)]
            self.value_cache = [torch.zeros(1, 2, 3, 4)]

        def get_seq_length(self):
            return self.key_cache[0].shape[-2]

    original = Legacy()
    model = torch.nn.Linear(2, 2)  # device and dtype come from the first floating-point parameter
    twin = copy_cache(original, model)
    twin.key_cache[0].add_(1)
    assert torch.equal(original.key_cache[0], torch.ones(1, 2, 3, 4)) and twin.get_seq_length() == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cache_reuse_matches_reprefill_and_cpu_cache_is_moved(llama_tiny):
    import copy

    tok = llama_tiny.tokenizer
    model = copy.deepcopy(llama_tiny.model).to("cuda")
    ids = DocumentPrompt(DOCUMENT).token_ids(tok)
    prefill = prefill_document(model, ids)
    assert all(k.is_cuda for k, _ in cache_tensors(prefill.cache))
    cached = generate(model, tok, _spec(), prefix_ids=ids, prefix_cache=prefill.cache)
    baseline = generate(model, tok, _spec(), prefix_ids=ids)
    assert cached.token_ids == baseline.token_ids
    cpu_cache = prefill_document(llama_tiny.model, ids).cache  # a cache from another device is moved on copy
    moved = generate(model, tok, _spec(), prefix_ids=ids, prefix_cache=cpu_cache)
    assert len(moved.token_ids) == len(cached.token_ids)


@pytest.fixture(scope="module")
def chat_llama(llama_tiny):
    import copy

    from tests.agents.conftest import CHATML_TEMPLATE

    tok = copy.deepcopy(llama_tiny.tokenizer)
    tok.chat_template = CHATML_TEMPLATE
    return llama_tiny.model, tok


def test_chat_native_cached_path_equals_full_reprefill(chat_llama):
    from agents import build_suffix
    from agents.builtin import summarizer

    model, tok = chat_llama
    ids = DocumentPrompt(DOCUMENT[:90]).token_ids(tok)  # the tiny model has 512 positions
    prefill = prefill_document(model, ids)
    short = AgentSpec(name="c", role="Be brief.", task="Improve: {summarizer}",  # 512 positions, char-level vocab
                      generation=GenerationSettings(max_new_tokens=10, repetition_penalty=1.3, no_repeat_ngram_size=2))
    for spec in (summarizer(max_new_tokens=10), short):
        up = {"summarizer": "The board approved a dividend."}
        assert build_suffix(tok, spec, up).chat_template
        cached = generate(model, tok, spec, prefix_ids=ids, prefix_cache=prefill.cache, upstream=up)
        full = generate(model, tok, spec, prefix_ids=ids, upstream=up)
        assert cached.token_ids == full.token_ids and full.reprefilled and not cached.reprefilled
        assert cached.prefix_tokens == len(ids)


def test_json_agent_decodes_under_the_grammar(chat_llama):
    """A random tiny model cannot write valid JSON by chance: only the grammar makes this parse."""
    import json

    from agents import OutputSpec

    model, tok = chat_llama
    ids = DocumentPrompt(DOCUMENT[:40]).token_ids(tok)
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6}}, "required": ["word"],
              "additionalProperties": False}
    spec = AgentSpec(name="j", task="Name one word from the document.",
                     generation=GenerationSettings(max_new_tokens=40),
                     output=OutputSpec(kind="json", json_schema=schema, max_repairs=0, instructions="JSON."))
    result = generate(model, tok, spec, prefix_ids=ids)
    assert result.constrained and result.finish_reason in ("stop", "eos")  # the grammar ends with EOS
    assert json.loads(result.text) == result.parsed and set(result.parsed) == {"word"}
    assert result.text.startswith('{\n  "word": "')  # the fixed 2-space layout: no free whitespace to pad with
