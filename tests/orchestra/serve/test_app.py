"""The HTTP API over a tiny family, in process: errors are OpenAI-shaped 4xx, auth, body limit, admission, streaming."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

from orchestra.serve import ChatCompletionRequest, ServeConfig, create_app
from orchestra.serve._errors import ConfigError
from tests.orchestra.serve.conftest import tiny_engine

BODY = {"model": "root", "messages": [{"role": "user", "content": "The committee reviewed the report."}],
        "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_serve_family):
    return tiny_engine(tiny_serve_family, max_body_bytes=4096, max_tokens_limit=64)


@pytest.fixture
async def client(engine):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine=engine)),
                                 base_url="http://test") as c:
        yield c


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


async def test_models_list_the_family_with_its_metadata(client):
    data = (await client.get("/v1/models")).json()["data"]
    assert {card["id"] for card in data} == {"root", "finetuned"}
    child = next(card for card in data if card["id"] == "finetuned")
    assert (child["parent"], child["name"], child["role"], child["max_context"]) == ("root", "tiny-child", "finetuned", 512)
    assert (await client.get("/v1/models/tiny-child")).json()["id"] == "finetuned"
    assert_openai_error(await client.get("/v1/models/nope"), 404, "model_not_found", "model")


async def test_a_completion_and_its_cache_headers(client):
    first = await client.post("/v1/chat/completions", json=BODY)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 4
    assert first.headers["x-request-id"]
    again = await client.post("/v1/chat/completions", json=BODY)
    assert again.json()["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]
    assert again.headers["x-orchestra-cache"] == "exact"
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == again.json()["usage"]["prompt_tokens"] - 1 == int(again.headers["x-orchestra-cached-tokens"])


async def test_streamed_chunks_end_with_finish_reason_usage_and_done(client):
    response = await client.post("/v1/chat/completions", json={**BODY, "stream": True,
                                                                "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 4
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
    plain = (await client.post("/v1/chat/completions", json=BODY)).json()["choices"][0]["message"]["content"]
    assert text == plain


@pytest.mark.parametrize(("change", "param"), [
    ({"seed": 2**70}, "seed"),
    ({"n": 2}, "n"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, None),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"model": ""}, "model"),
])
async def test_bad_parameters_are_400_naming_the_parameter(client, change, param):
    error = assert_openai_error(await client.post("/v1/chat/completions", json={**BODY, **change}), 400,
                                "invalid_request")
    if param is not None:
        assert error["param"] == param or error["param"].startswith(param), error


async def test_limits_and_unknowns_are_4xx(client):
    assert_openai_error(await client.post("/v1/chat/completions", json={**BODY, "model": "gpt-4"}), 404,
                        "model_not_found", "model")
    assert_openai_error(await client.post("/v1/chat/completions", json={**BODY, "max_tokens": 65}), 400,
                        "invalid_request", "max_tokens")
    too_long = {**BODY, "max_tokens": 64, "messages": [{"role": "user", "content": "report " * 480}]}
    assert_openai_error(await client.post("/v1/chat/completions", json=too_long), 400, "context_length_exceeded")
    assert_openai_error(await client.get("/v1/nothing-here"), 404, "not_found")
    assert_openai_error(await client.delete("/v1/models"), 405)


async def test_malformed_json_is_400_saying_so(client):
    for raw in (b"{not json", b"", b"[1, 2]", b'{"model": "root", "messages": [}'):
        response = await client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        error = assert_openai_error(response, 400, "invalid_request")
        if raw.startswith(b"{"):
            assert "not valid JSON" in error["message"] and error["param"] is None, error


async def test_bodies_over_the_limit_are_413_with_or_without_content_length(client):
    big = {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_openai_error(await client.post("/v1/chat/completions", json=big), 413, "payload_too_large")

    async def chunks():
        for _ in range(10):
            yield b" " * 1000
        yield json.dumps(BODY).encode()

    assert_openai_error(await client.post("/v1/chat/completions", content=chunks(),
                                          headers={"content-type": "application/json"}), 413, "payload_too_large")


async def test_bearer_key_is_required_when_configured(tiny_serve_family, monkeypatch):
    monkeypatch.setenv("TINY_SERVE_KEY", "s3cret")
    app = create_app(engine=tiny_engine(tiny_serve_family, api_key_env="TINY_SERVE_KEY"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                        {"authorization": "Basic s3cret"}):
            error = assert_openai_error(await c.post("/v1/chat/completions", json=BODY, headers=headers), 401,
                                        "invalid_api_key")
            assert error["type"] == "authentication_error"
        assert_openai_error(await c.get("/v1/models"), 401)
        assert (await c.get("/v1/models", headers={"authorization": "Bearer s3cret"})).status_code == 200
        ok = await c.post("/v1/chat/completions", json=BODY, headers={"authorization": "bearer s3cret"})
        assert ok.status_code == 200, ok.text
        for open_path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert (await c.get(open_path)).status_code == 200, open_path


def test_an_unset_key_variable_is_refused_at_start(monkeypatch):
    monkeypatch.delenv("TINY_SERVE_MISSING", raising=False)
    with pytest.raises(ConfigError, match="TINY_SERVE_MISSING"):
        ServeConfig(api_key_env="TINY_SERVE_MISSING").api_key()


async def test_a_full_queue_is_429_and_counted(tiny_serve_family):
    engine = tiny_engine(tiny_serve_family, max_concurrent=1, max_queue=0)
    app = create_app(engine=engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        req = ChatCompletionRequest.model_validate({**BODY, "max_tokens": 64})
        async with engine.open(req) as gen:  # holds the only slot
            error = assert_openai_error(await c.post("/v1/chat/completions", json=BODY), 429, "queue_full")
            assert error["type"] == "rate_limit_error"
            await gen.text()
        assert (await c.post("/v1/chat/completions", json=BODY)).status_code == 200
        metrics = (await c.get("/metrics")).text
    assert "orchestra_rejected_requests_total 1.0" in metrics


async def test_waiting_requests_are_served_in_turn(tiny_serve_family):
    engine = tiny_engine(tiny_serve_family, max_concurrent=1, max_queue=8)
    app = create_app(engine=engine)
    results: list[int] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        async def ask(i: int) -> None:
            body = {**BODY, "messages": [{"role": "user", "content": f"Question {i} about the report."}]}
            results.append((await c.post("/v1/chat/completions", json=body)).status_code)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(ask, i)
    assert results == [200] * 4


async def test_json_modes_return_json(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}):
        response = await client.post("/v1/chat/completions", json={**BODY, "max_tokens": 48, "response_format": fmt})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            assert isinstance(value, dict)
            if fmt["type"] == "json_schema":
                assert set(value) == {"n"} and isinstance(value["n"], int)


async def test_an_unusable_json_schema_is_400(client):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 5}}}
    assert_openai_error(await client.post("/v1/chat/completions", json={**BODY, "response_format": bad}), 400,
                        param="response_format")


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": "object", "properties": {"n": {"type": "string", "minLength": -1}}}, "invalid JSON schema at properties/n/minLength"),
    ({"$ref": "https://example.com/schema.json"}, "only $ref inside the schema"),
])
async def test_a_wrong_json_schema_is_a_400_saying_where_and_a_remote_ref_is_never_fetched(client, schema, says):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    reply = await client.post("/v1/chat/completions", json={**BODY, "response_format": fmt})
    assert_openai_error(reply, 400, param="response_format")
    assert says in reply.json()["error"]["message"]


async def test_metrics_count_requests_tokens_and_cache_paths(client):
    await client.post("/v1/chat/completions", json=BODY)
    text = (await client.get("/metrics")).text
    for name in ("orchestra_requests_total", "orchestra_tokens_total", "orchestra_cache_lookups_total",
                 "orchestra_ttft_seconds_bucket", "orchestra_cache_bytes", "orchestra_cache_budget_bytes",
                 "orchestra_queued_requests", "orchestra_running_generations", "orchestra_prefill_seconds_saved_total"):
        assert name in text, name
    assert 'orchestra_cache_lookups_total{model_name="root",path="exact"}' in text


async def test_prefill_warms_the_cache_for_later_requests(client):
    messages = [{"role": "system", "content": "Costs fell as the new plant came online. " * 6}]
    warm = await client.post("/v1/cache/prefill", json={"model": "root", "messages": messages})
    assert warm.status_code == 200, warm.text
    assert warm.json()["tokens"] > 20
    body = {**BODY, "messages": [*messages, {"role": "user", "content": "And the board?"}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm.json()["tokens"]


async def test_the_app_mounts_inside_another_asgi_app(tiny_serve_family, monkeypatch):
    from fastapi import FastAPI

    monkeypatch.setenv("TINY_SERVE_KEY", "s3cret")
    outer = FastAPI()

    @outer.get("/")
    def home() -> dict[str, str]:
        return {"app": "mine"}

    outer.mount("/llm", create_app(engine=tiny_engine(tiny_serve_family, api_key_env="TINY_SERVE_KEY")))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=outer), base_url="http://test") as c:
        assert (await c.get("/")).json() == {"app": "mine"}
        assert (await c.get("/llm/healthz")).status_code == 200  # open paths stay open under a prefix
        assert (await c.post("/llm/v1/chat/completions", json=BODY)).status_code == 401
        ok = await c.post("/llm/v1/chat/completions", json=BODY, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.headers["x-orchestra-cache"] == "exact"


async def test_request_metrics_are_labelled_by_route_not_by_raw_path(client):
    for name in ("made-up-1", "made-up-2"):
        await client.get(f"/v1/models/{name}")
    await client.get("/no/such/path")
    text = (await client.get("/metrics")).text
    assert 'route="/v1/models/{model}",status="404"' in text and "made-up" not in text
    assert 'route="unmatched",status="404"' in text


async def test_an_idle_server_hands_freed_memory_back(client, monkeypatch):
    import orchestra.serve._engine as engine_module

    calls: list[int] = []
    monkeypatch.setattr(engine_module, "release_memory", lambda: calls.append(1))
    assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200
    assert calls == [1]  # the last running generation ended
    monkeypatch.undo()
    engine_module.release_memory()  # the real one: malloc_trim in a thread, harmless anywhere


async def test_a_streamed_reply_closes_its_generation_however_the_response_ends():
    """A send that fails mid-reply (a hang-up) ends the response with the body generator still suspended:
    the generation is closed all the same, not when the generator is collected."""
    from orchestra.serve._app import _ClosingStream

    ended: list[bool] = []

    async def body():
        yield "data: first\n\n"
        await anyio.sleep(3600)  # a reply that would go on for a long time
        yield "data: never\n\n"

    async def on_end() -> None:
        ended.append(True)

    async def receive():
        await anyio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            raise OSError("connection reset by peer")

    gen = body()
    response = _ClosingStream(gen, on_end=on_end, media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST", "path": "/",
             "headers": []}
    with anyio.fail_after(10):
        with pytest.raises(BaseException):  # noqa: B017 - whatever Starlette makes of the broken send
            await response(scope, receive, send)
    assert ended == [True]
    assert gen.ag_frame is not None  # the generator itself was not run to its end
    await gen.aclose()


async def test_a_clients_request_id_is_kept_and_a_malformed_one_replaced(client):
    kept = await client.get("/v1/models", headers={"x-request-id": "trace-42.a:b"})
    assert kept.headers["x-request-id"] == "trace-42.a:b"
    replaced = await client.get("/v1/models", headers={"x-request-id": "no spaces allowed " * 20})
    assert replaced.headers["x-request-id"] and " " not in replaced.headers["x-request-id"]
    fresh = await client.get("/v1/models")
    assert len(fresh.headers["x-request-id"]) == 16


async def test_vllm_named_series_count_tokens_latency_and_prefix_hits(client):
    def sample(text: str, name: str, **labels: str) -> float:
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    before = (await client.get("/metrics")).text
    first = (await client.post("/v1/chat/completions", json=BODY)).json()
    again = (await client.post("/v1/chat/completions", json=BODY)).json()
    after = (await client.get("/metrics")).text
    prompt = first["usage"]["prompt_tokens"] + again["usage"]["prompt_tokens"]
    generated = first["usage"]["completion_tokens"] + again["usage"]["completion_tokens"]
    delta = {name: sample(after, name, model_name="root") - sample(before, name, model_name="root")
             for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                          "vllm:prefix_cache_hits_total", "vllm:e2e_request_latency_seconds_count",
                          "vllm:time_to_first_token_seconds_count")}
    assert delta["vllm:prompt_tokens_total"] == delta["vllm:prefix_cache_queries_total"] == prompt
    assert delta["vllm:generation_tokens_total"] == generated
    assert delta["vllm:prefix_cache_hits_total"] >= again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert delta["vllm:e2e_request_latency_seconds_count"] == delta["vllm:time_to_first_token_seconds_count"] == 2
    assert sample(after, "vllm:num_requests_running", model_name="root") == 0


async def test_a_finished_request_keeps_no_k_v_the_budget_stopped_counting(tiny_serve_family):
    import weakref

    engine = tiny_engine(tiny_serve_family)
    req = ChatCompletionRequest.model_validate(BODY)
    async with engine.open(req) as gen:
        await gen.text()
        keys = weakref.ref(gen.lease.local_cache().layers[0].keys)
    assert gen.lease.cache is None  # the Generation lives on here, as a response object's may
    engine.cache.pool.clear()  # the entry leaves the budget (evicted): its K/V must go with it
    assert keys() is None
    engine.close()
