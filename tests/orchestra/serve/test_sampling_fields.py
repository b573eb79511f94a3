"""Every OpenAI sampling field is honoured or refused: penalties, logit_bias, top_k, min_p, logprobs; unknown fields 400.

On the tiny family, greedy unless a test says otherwise, batched and alone (the two decoding paths). The raw
log-probabilities a reply reports (`logprobs`) are the model's own, so the penalties' effect is checked exactly
against them: under greedy decoding each chosen token is the best of the reported top tokens once the penalties
are subtracted.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import httpx
import openai
import pytest

from orchestra.serve import ChatCompletionRequest, create_app
from tests.orchestra.serve.conftest import tiny_engine
from tests.orchestra.serve.test_app import assert_openai_error

MESSAGES = [{"role": "user", "content": "The committee reviewed the report."}]
BODY = {"model": "root", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
TOKEN = 100
"""A token id the tiny model never picks unbiased (a lone byte)."""


@pytest.fixture(scope="module", params=[True, False], ids=["batched", "alone"])
def engine(request, tiny_serve_family):
    engine = tiny_engine(tiny_serve_family, batch_decode=request.param)
    yield engine
    engine.close()


@pytest.fixture
async def client(engine):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine=engine)),
                                 base_url="http://test") as c:
        yield c


async def reply(engine, **fields) -> tuple[list[int], list[int], list]:
    """The reply's token ids, the prompt's, and the reported log-probabilities (when asked for)."""
    req = ChatCompletionRequest.model_validate({**BODY, **fields})
    async with engine.open(req) as gen:
        await gen.text()
    assert gen.result is not None
    return list(gen.result.token_ids), list(gen.prompt_ids), list(gen.token_logprobs)


def repeats(ids: list[int]) -> int:
    return sum(n - 1 for n in Counter(ids).values())


async def test_a_huge_logit_bias_on_one_token_makes_greedy_decoding_emit_it(engine):
    plain, _, _ = await reply(engine)
    assert TOKEN not in plain
    biased, _, _ = await reply(engine, logit_bias={str(TOKEN): 100})
    assert biased == [TOKEN] * 12
    against, _, _ = await reply(engine, logit_bias={str(plain[0]): -100})
    assert against[0] != plain[0]


async def test_top_k_1_and_min_p_1_sample_as_greedy(engine):
    greedy, _, _ = await reply(engine)
    assert (await reply(engine, temperature=1.0, top_k=1, seed=5))[0] == greedy
    assert (await reply(engine, temperature=1.5, min_p=1.0, seed=5))[0] == greedy
    # off values change nothing: the same seeded draw as without them
    seeded, _, _ = await reply(engine, temperature=1.0, seed=11)
    assert (await reply(engine, temperature=1.0, seed=11, top_k=-1, min_p=0.0))[0] == seeded
    assert (await reply(engine, temperature=1.0, seed=11, top_k=0))[0] == seeded


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
async def test_presence_and_frequency_penalties_stop_a_repeated_token(engine, penalty):
    plain, _, _ = await reply(engine)
    assert repeats(plain) >= 3  # the tiny model loops
    ids, _, logprobs = await reply(engine, **{penalty: 2.0}, logprobs=True, top_logprobs=20)
    assert repeats(ids) < repeats(plain)
    # exactly OpenAI's rule: each token is the best reported one once 2 x (count, or seen) is subtracted
    for i, step in enumerate(logprobs):
        counts = Counter(ids[:i])
        scored = {t: lp - 2.0 * (counts[t] if penalty == "frequency_penalty" else min(counts[t], 1))
                  for t, lp in step.top}
        assert step.token_id == ids[i] == max(scored, key=scored.__getitem__)
    encouraged, _, _ = await reply(engine, **{penalty: -2.0})
    assert repeats(encouraged) > repeats(plain)


async def test_repetition_penalty_counts_the_prompt_and_the_reply(engine):
    plain, prompt, _ = await reply(engine)
    assert set(plain) & set(prompt) and repeats(plain)
    ids, _, _ = await reply(engine, repetition_penalty=100.0)
    assert not set(ids) & set(prompt) and repeats(ids) == 0
    assert (await reply(engine, repetition_penalty=1.0))[0] == plain


async def test_logprobs_are_the_raw_models_whatever_the_bias_and_penalties(engine):
    ids, _, plain = await reply(engine, logprobs=True, top_logprobs=5)
    assert len(plain) == len(ids) and all(len(step.top) == 5 for step in plain)
    for step in plain:  # greedy: the chosen token is the top one
        assert step.top[0] == (step.token_id, step.logprob)
        assert sum(math.exp(lp) for _, lp in step.top) <= 1.0 + 1e-6
        assert [lp for _, lp in step.top] == sorted((lp for _, lp in step.top), reverse=True)
    biased_ids, _, biased = await reply(engine, logprobs=True, top_logprobs=5, logit_bias={str(TOKEN): 100},
                                        frequency_penalty=2.0)
    assert biased[0].top == plain[0].top  # the same first step: what the model said, before the bias
    assert biased[0].token_id == TOKEN and biased[0].logprob < plain[0].logprob


async def test_chat_logprobs_come_back_openai_shaped_streamed_and_not(client):
    body = {**BODY, "logprobs": True, "top_logprobs": 3}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == response.json()["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["token"] == entry["token"]
        assert sum(math.exp(t["logprob"]) for t in entry["top_logprobs"]) <= 1.0 + 1e-6
    assert "".join(e["token"] for e in content) == choice["message"]["content"]

    streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    pieces = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    joined = [e for p in pieces for e in p["logprobs"]["content"]]
    assert "".join(p["delta"]["content"] for p in pieces) == "".join(e["token"] for e in joined)
    assert [e["token"] for e in joined] == [e["token"] for e in content]
    assert [e["logprob"] for e in joined] == pytest.approx([e["logprob"] for e in content], abs=1e-4)

    plain = (await client.post("/v1/chat/completions", json=BODY)).json()["choices"][0]
    assert plain["logprobs"] is None
    chosen_only = (await client.post("/v1/chat/completions", json={**BODY, "logprobs": True})).json()
    assert all(e["top_logprobs"] == [] for e in chosen_only["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize(("change", "param", "says"), [
    ({"best_of": 2}, "best_of", "does not support"),
    ({"echo": True}, "echo", "does not support"),
    ({"suffix": "x"}, "suffix", "does not support"),
    ({"functions": [{"name": "f"}]}, "functions", "does not support"),
    ({"ignore_eos": True}, "ignore_eos", "does not support"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "does not support"),
    ({"n": 2}, "n", "1 to 1"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "-2 to 2"),
    ({"presence_penalty": -3}, "presence_penalty", "-2 to 2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "more than 0"),
    ({"top_k": -2}, "top_k", "-1 to"),
    ({"min_p": 1.5}, "min_p", "0 to 1"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "0 to 20"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"logprobs": 1}, "logprobs", "valid boolean"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", "-100 to 100"),
    ({"logit_bias": {"five": 1}}, "logit_bias", ""),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "does not have"),
    ({"modalities": ["text", "audio"]}, "modalities", ""),
    ({"logprobs": True, "tools": [{"type": "function", "function": {"name": "f"}}]}, "logprobs", "tools"),
])
async def test_refused_fields_are_400_naming_them(client, change, param, says):
    error = assert_openai_error(await client.post("/v1/chat/completions", json={**BODY, **change}), 400,
                                "invalid_request")
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(param + "."), error
    assert says in error["message"], error


async def test_harmless_metadata_fields_are_accepted(client):
    harmless = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                "parallel_tool_calls": True, "prompt_cache_key": "doc-1", "safety_identifier": "s",
                "modalities": ["text"], "stream_options": None, "top_logprobs": 0}
    with_them = await client.post("/v1/chat/completions", json={**BODY, **harmless})
    assert with_them.status_code == 200, with_them.text
    without = await client.post("/v1/chat/completions", json=BODY)
    assert with_them.json()["choices"][0]["message"] == without.json()["choices"][0]["message"]


@pytest.fixture
async def official(engine):
    """The official `openai` client over the app (in process: its own httpx's ASGI transport)."""
    import httpx2

    app = create_app(engine=engine)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test") as http:
        yield openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)


async def test_the_official_client_reads_logprobs_streamed_and_not(official):
    completion = await official.chat.completions.create(model="root", messages=MESSAGES, max_tokens=6,
                                                        temperature=0, logprobs=True, top_logprobs=4)
    choice = completion.choices[0]
    content = choice.logprobs.content
    assert len(content) == completion.usage.completion_tokens
    for entry in content:  # greedy: the chosen token is the top-1, at the same log-probability
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob
        assert len(entry.top_logprobs) == 4 and sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-6

    stream = await official.chat.completions.create(model="root", messages=MESSAGES, max_tokens=6, temperature=0,
                                                    logprobs=True, top_logprobs=4, stream=True)
    streamed = [entry async for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


async def test_the_official_client_raises_bad_request_naming_the_field(official):
    with pytest.raises(openai.BadRequestError) as refused:
        await official.chat.completions.create(model="root", messages=MESSAGES, max_tokens=2,
                                               extra_body={"best_of": 3})
    assert refused.value.status_code == 400 and refused.value.param == "best_of"
    assert refused.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as out_of_range:
        await official.chat.completions.create(model="root", messages=MESSAGES, max_tokens=2, presence_penalty=4)
    assert out_of_range.value.param == "presence_penalty" and "-2 to 2" in out_of_range.value.message


async def test_metrics_expose_inter_token_latency_kv_usage_and_model_name_labels(client):
    def sample(text: str, name: str, **labels: str) -> float:
        total = 0.0
        for line in text.splitlines():
            head = line.split("{", 1)[0].split(" ", 1)[0]
            if head == name and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    before = (await client.get("/metrics")).text
    done = (await client.post("/v1/chat/completions", json={**BODY, "max_tokens": 5})).json()
    after = (await client.get("/metrics")).text
    tokens = done["usage"]["completion_tokens"]
    assert tokens > 1

    def delta(name: str) -> float:
        return sample(after, name, model_name="root") - sample(before, name, model_name="root")

    assert delta("vllm:inter_token_latency_seconds_count") == tokens - 1  # one per gap between tokens
    assert delta("vllm:request_time_per_output_token_seconds_count") == 1
    assert "vllm:time_per_output_token_seconds" not in after
    usage = [line for line in after.splitlines() if line.startswith("vllm:kv_cache_usage_perc{")]
    assert {line.split('"')[1] for line in usage} == {"root", "finetuned"}
    assert all(0.0 <= float(line.rsplit(" ", 1)[1]) <= 1.0 for line in usage)
    for name in ("orchestra_tokens_total", "orchestra_cached_prompt_tokens_total", "orchestra_cache_lookups_total",
                 "orchestra_ttft_seconds_count"):
        series = [line for line in after.splitlines() if line.startswith(name + "{")]
        assert series and all('model_name="' in line and ' model="' not in line and '{model="' not in line
                              for line in series), name


async def test_kv_usage_counts_what_requests_hold_against_the_budget(engine):
    from prometheus_client import generate_latest

    def usage() -> float:
        text = generate_latest(engine.metrics.registry).decode()
        line = next(line for line in text.splitlines() if line.startswith('vllm:kv_cache_usage_perc{model_name="root"'))
        return float(line.rsplit(" ", 1)[1])

    pool = engine.cache.pool
    idle = usage()
    assert idle == pytest.approx((pool.pinned_bytes + pool.reserved_bytes + pool.outside_bytes) / pool.budget_bytes)
    pool.hold(pool.budget_bytes // 4)
    try:
        assert usage() == pytest.approx(idle + 0.25, abs=1e-6)
    finally:
        pool.release(pool.budget_bytes // 4)
    assert usage() == pytest.approx(idle)
