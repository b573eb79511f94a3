"""JSON agents through the real generation path.

A tiny model cannot be relied on to write JSON, so the model is wrapped: every forward pass still runs
the real model over the real (copied) cache, but the returned logits force a scripted reply, one
script per attempt. This exercises the decode loop, the stop-at-complete-object rule, the repair
suffix over the shared cache, and truncation at max_new_tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from agents import (
    AgentSpec,
    DocumentPrompt,
    GenerationSettings,
    OutputSpec,
    TruncatedOutputError,
    cache_length,
    generate,
    prefill_document,
)
from agents.builtin import KeyFacts
from tests.agents.conftest import DOCUMENT


class Forced(torch.nn.Module):
    """Runs the real model, then forces the next token from a per-attempt script."""

    def __init__(self, model, scripts: list[list[int]]) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        self.generation_config = model.generation_config
        self.scripts = scripts
        self.attempt = -1
        self.step = 0
        self.prefill_lengths: list[int] = []

    def forward(self, input_ids=None, position_ids=None, cache=None, use_cache=None, logits_to_keep=0):
        out = self.inner(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=use_cache,
                         logits_to_keep=logits_to_keep)
        if input_ids.shape[1] > 1:  # a suffix prefill starts a new attempt
            self.attempt += 1
            self.step = 0
            self.prefill_lengths.append(int(position_ids[0, -1]) + 1)
        script = self.scripts[self.attempt]
        token = script[min(self.step, len(script) - 1)]
        self.step += 1
        logits = torch.full_like(out.logits, float("-inf"))
        logits[..., token] = 0.0
        return SimpleNamespace(logits=logits)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def prefix(llama_tiny):
    ids = DocumentPrompt(DOCUMENT[:80]).token_ids(llama_tiny.tokenizer)
    return ids, prefill_document(llama_tiny.model, ids)


def test_invalid_json_is_repaired_over_the_shared_cache(llama_tiny, prefix):
    tok = llama_tiny.tokenizer
    ids, prefill = prefix
    junk = _ids(tok, " and more text that must never be generated")
    forced = Forced(llama_tiny.model, [
        _ids(tok, 'Sure: {"facts": []}') + junk,
        _ids(tok, '{"facts": ["Revenue grew."]}') + junk,
    ])
    events = []
    spec = AgentSpec(name="facts", role="Be exact.", task="List facts.",
                     generation=GenerationSettings(max_new_tokens=40),
                     output=OutputSpec(kind="json", model=KeyFacts, max_repairs=1, instructions="JSON only.",
                                       constrained=False))  # the unconstrained path: tracker + repairs
    out = generate(forced, tok, spec, prefix_ids=ids, prefix_cache=prefill.cache, on_token=events.append)
    assert out.attempts == 2 and out.parsed == KeyFacts(facts=["Revenue grew."])
    assert out.finish_reason == "stop" and out.text.strip().endswith("]}") and "more text" not in out.text
    assert out.downstream_text() == '{"facts":["Revenue grew."]}'
    # the repair attempt's suffix carries the rejected reply, so it is longer; both start after the document
    first_len, second_len = forced.prefill_lengths
    assert len(ids) < first_len < second_len
    assert {e.attempt for e in events} == {0, 1}
    assert "".join(e.text for e in events if e.attempt == 1) == out.text
    assert cache_length(prefill.cache) == len(ids)


def test_json_cut_off_by_max_new_tokens_is_a_truncation(llama_tiny, prefix):
    tok = llama_tiny.tokenizer
    ids, prefill = prefix
    endless = _ids(tok, '{"facts": ["the committee reviewed the annual report and found')
    forced = Forced(llama_tiny.model, [endless, endless])
    spec = AgentSpec(name="facts", task="List the facts.", generation=GenerationSettings(max_new_tokens=8),
                     output=OutputSpec(kind="json", model=KeyFacts, max_repairs=1, instructions="JSON only.",
                                       constrained=False))  # the unconstrained path: tracker + repairs
    with pytest.raises(TruncatedOutputError) as info:
        generate(forced, tok, spec, prefix_ids=ids, prefix_cache=prefill.cache)
    assert info.value.attempts == 2 and info.value.max_new_tokens == 8
    assert info.value.raw_output.startswith('{"facts"')
    assert forced.attempt == 1


def test_json_agent_with_reprefill_baseline(llama_tiny, prefix):
    tok = llama_tiny.tokenizer
    ids, _ = prefix
    forced = Forced(llama_tiny.model, [_ids(tok, '{"n": 3} trailing')])
    spec = AgentSpec(name="count", task="Count.", generation=GenerationSettings(max_new_tokens=16), output=OutputSpec(
        kind="json", json_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        constrained=False))
    out = generate(forced, tok, spec, prefix_ids=ids, prefix_cache=None)
    assert out.parsed == {"n": 3} and out.reprefilled and out.attempts == 1
