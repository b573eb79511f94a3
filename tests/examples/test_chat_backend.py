"""The chat backend example, driven in-process over HTTP on the real family."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from examples.chat_backend.app import create_app
from examples.chat_backend.config import ChatConfig
from examples.chat_backend.engine import ChatEngine
from examples.chat_backend.sse import parse_events
from orchestra.mapstore import MappingStore
from orchestra.registry import ModelRegistry

pytestmark = pytest.mark.real_model

# The probe runs on the conversation's last tokens, which calibration never saw; thresholds as in the
# scheduler's real-model test. `tail_tokens` 32 matches the stored probe references (nothing re-measured).
LOOSE = {"offline": {"max_kl": 1.0}, "probe": {"tokens": 32, "max_excess_nll": 1.0, "max_excess_kl": 0.5}}


@pytest.fixture(scope="module")
def shared(real_family):
    """Loaded models and mappings shared by every test's engine (engines hold event-loop locks, so one per test)."""
    aliases = {record.role: name for name, record in real_family.members.items()}
    registry = ModelRegistry(aliases, family=real_family, default_device="cpu")
    mappings = MappingStore(Path(real_family.home) / "mappings", on_missing="refuse")
    return real_family, registry, mappings


def _app(shared, **config):
    family, registry, mappings = shared
    settings = {"device": "cpu", "gate": LOOSE, "tail_tokens": 32, "default_max_new_tokens": 8, **config}
    engine = ChatEngine(ChatConfig(**settings), family=family, registry=registry, mappings=mappings)
    return create_app(engine=engine)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://chat", timeout=600)


async def _message(client, session_id, content, **extra):
    response = await client.post(f"/sessions/{session_id}/messages", json={"content": content, **extra})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return parse_events(response.text)


def _check_reply(events, model, path):
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "start" and kinds[-1] == "done", kinds
    assert "error" not in kinds, events
    tokens = [data for kind, data in events if kind == "token"]
    assert tokens, "no token streamed"
    assert [t["index"] for t in tokens] == sorted(t["index"] for t in tokens)
    cache = next(data for kind, data in events if kind == "cache")
    assert cache["model"] == model and cache["path"] == path
    assert kinds.index("cache") < kinds.index("token")  # the cache path is known before the first token
    done = events[-1][1]
    assert done["model"] == model and done["cache_path"] == path
    assert done["reply"] == "".join(t["text"] for t in tokens) and done["reply"].strip()
    assert 0 < done["tokens"] <= 8 and done["finish_reason"] in {"eos", "length"}
    timings = done["timings"]
    assert timings["prompt_tokens"] > 0 and timings["ttft_s"] is not None and timings["total_s"] >= timings["ttft_s"]
    return done, cache


async def test_chat_switches_model_by_mapping_the_session(shared, short_document):
    async with _client(_app(shared)) as client:
        r = await client.post("/documents", json={"text": short_document, "name": "gpl-head"})
        assert r.status_code == 201, r.text
        doc = r.json()
        assert doc["tokens"] > 200 and doc["source_model"] == "root" and doc["caches"]["root"]["path"] == "exact"
        again = await client.post("/documents", json={"text": short_document})
        assert again.status_code == 200 and again.json()["document_id"] == doc["document_id"]
        assert again.json()["reused"] is True  # the same document is prefilled once

        r = await client.post("/sessions", json={"document_id": doc["document_id"], "model": "root"})
        assert r.status_code == 201, r.text
        sid = r.json()["session_id"]

        first, cache = _check_reply(await _message(client, sid, "What is this document?"), "root", "exact")
        assert cache["reused_tokens"] == doc["tokens"]  # the document's own prefill, shared

        events = await _message(client, sid, "Who publishes it?", model="finetuned")
        kinds = [kind for kind, _ in events]
        assert kinds.index("switch") < kinds.index("gate") < kinds.index("cache") < kinds.index("token")
        switch = next(data for kind, data in events if kind == "switch")
        assert switch["from"] == "root" and switch["to"] == "finetuned" and switch["conversation_tokens"] > 0
        gates = {data["gate"]: data for kind, data in events if kind == "gate"}
        assert set(gates) == {"offline", "probe"} and all(g["passed"] for g in gates.values())
        assert "excess_nll" in gates["probe"]["metrics"]
        assert "fallback" not in kinds
        done, cache = _check_reply(events, "finetuned", "mapped")
        assert cache["switched"] is True and cache["from"] == "root" and cache["source"] == "root"
        # the root's cache of the document and the whole first prompt was mapped: all of it but the
        # recomputed tail (32) is reused; the first reply and the new message are computed
        assert cache["reused_tokens"] + 32 >= doc["tokens"] + switch["conversation_tokens"] - first["tokens"] - 1
        assert cache["reused_tokens"] + cache["computed_tokens"] == cache["tokens"] == done["context_tokens"] - \
            done["tokens"] - 1
        assert done["timings"]["cached_tokens"] == cache["reused_tokens"]
        assert done["timings"]["prompt_tokens"] == cache["computed_tokens"] + 1

        state = (await client.get(f"/sessions/{sid}")).json()
        assert state["model"] == "finetuned" and state["cache"]["path"] == "mapped"
        assert [m["role"] for m in state["messages"]] == ["user", "assistant"] * 2
        assert state["messages"][1]["content"] == first["reply"] and state["messages"][3]["content"] == done["reply"]
        assert state["context_tokens"] == done["context_tokens"] > doc["tokens"]


async def test_failed_gate_falls_back_to_reprefill_and_says_so(shared, short_document):
    strict = {"offline": {"max_kl": 0.0}, "probe": None}  # no mapping has zero held-out KL
    async with _client(_app(shared, gate=strict)) as client:
        doc = (await client.post("/documents", json={"text": short_document})).json()
        sid = (await client.post("/sessions", json={"document_id": doc["document_id"], "model": "root"})).json()[
            "session_id"]
        _check_reply(await _message(client, sid, "What is this document?"), "root", "exact")
        r = await client.post(f"/sessions/{sid}/switch", json={"model": "finetuned"})
        assert r.status_code == 200, r.text
        body = r.json()
        kinds = [e["event"] for e in body["events"]]
        assert kinds == ["switch", "gate", "fallback", "cache"]
        assert body["events"][1]["passed"] is False
        assert "offline gate failed" in body["events"][2]["reason"]
        assert body["session"]["model"] == "finetuned" and body["session"]["cache"]["path"] == "reprefilled"
        assert body["session"]["cache"]["fallback_reason"] == body["events"][2]["reason"]
        assert body["session"]["cache"]["source"] == "root" and body["events"][3]["switched"] is True
        # the re-prefilled cache is the member's own now: the next turn extends it exactly
        _, cache = _check_reply(await _message(client, sid, "Who publishes it?"), "finetuned", "exact")
        assert cache["reused_tokens"] == body["session"]["cache"]["tokens"]


async def test_bad_input_gets_json_errors_and_the_server_keeps_serving(shared, short_document):
    async with _client(_app(shared, max_new_tokens_limit=20_000)) as client:
        doc = (await client.post("/documents", json={"text": short_document})).json()
        did = doc["document_id"]
        sid = (await client.post("/sessions", json={"document_id": did, "model": "root"})).json()["session_id"]

        async def expect(response, status, error_type):
            assert response.status_code == status, response.text
            assert response.headers["content-type"].startswith("application/json")
            error = response.json()["error"]
            assert error["status"] == status and error["type"] == error_type and error["message"]
            return error

        await expect(await client.post("/sessions/nope/messages", json={"content": "hi"}), 404, "session_not_found")
        await expect(await client.get("/sessions/nope"), 404, "session_not_found")
        await expect(await client.get("/documents/nope"), 404, "document_not_found")
        await expect(await client.post("/sessions", json={"document_id": "nope", "model": "root"}), 404,
                     "document_not_found")
        error = await expect(await client.post("/sessions", json={"document_id": did, "model": "gpt-4"}), 422,
                             "unknown_model")
        assert "finetuned" in error["message"]  # lists what to use instead
        await expect(await client.post(f"/sessions/{sid}/messages", json={"content": "hi", "model": "gpt-4"}), 422,
                     "unknown_model")
        await expect(await client.post(f"/sessions/{sid}/switch", json={"model": "gpt-4"}), 422, "unknown_model")
        await expect(await client.post(f"/sessions/{sid}/messages", json={}), 422, "invalid_request")
        await expect(await client.post(f"/sessions/{sid}/messages", content=b"{not json"), 400, "bad_request")
        await expect(await client.post("/documents", json={"text": "   "}), 422, "invalid_document")
        await expect(await client.post("/documents", json={"bundled": "nope.txt"}), 404, "bundled_document_not_found")
        await expect(await client.post("/documents", json={"text": "a", "bundled": "gpl-3.txt"}), 422,
                     "invalid_request")
        await expect(await client.post(f"/sessions/{sid}/messages", json={"content": "hi", "max_new_tokens": 30_000}),
                     400, "bad_request")
        await expect(await client.post(f"/sessions/{sid}/messages", json={"content": "hi", "max_new_tokens": 9000}),
                     409, "context_full")
        await expect(await client.get("/no/such/route"), 404, "http_error")

        bundled = (await client.get("/documents/bundled")).json()["bundled"]
        assert "gpl-3.txt" in bundled
        models = (await client.get("/models")).json()
        assert models["source"] == "root" and {m["alias"] for m in models["models"]} >= {"root", "finetuned"}

        # after all that, sessions still work; a deleted one is gone
        _check_reply(await _message(client, sid, "What is this document?"), "root", "exact")
        assert (await client.delete(f"/sessions/{sid}")).status_code == 204
        await expect(await client.get(f"/sessions/{sid}"), 404, "session_not_found")


async def test_concurrent_messages_on_one_session_are_serialized(shared, short_document):
    async with _client(_app(shared)) as client:
        did = (await client.post("/documents", json={"text": short_document})).json()["document_id"]
        sid = (await client.post("/sessions", json={"document_id": did, "model": "root"})).json()["session_id"]
        replies: dict[str, dict] = {}

        async def ask(content: str) -> None:
            events = await _message(client, sid, content, max_new_tokens=6)
            replies[content] = events[-1][1]
            assert [k for k, _ in events].count("done") == 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "What is this document?")
            tg.start_soon(ask, "Who wrote it?")

        state = (await client.get(f"/sessions/{sid}")).json()
        messages = state["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 2
        # each question is directly followed by its own answer: the two turns did not interleave
        for i in (0, 2):
            assert messages[i + 1]["content"] == replies[messages[i]["content"]]["reply"]
        assert {messages[0]["content"], messages[2]["content"]} == set(replies)
        later = max(replies.values(), key=lambda d: d["context_tokens"])
        assert state["context_tokens"] == later["context_tokens"]
