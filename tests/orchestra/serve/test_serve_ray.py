"""`orchestra serve` under the ray executor, on the tiny llama pair, through the official `openai` client.

One local Ray per module (2 CPUs, no dashboard) and one live server (uvicorn in a thread) whose two
members are Ray actors; a twin engine on the local executor over the same models and mapping is the
reference. Replies (greedy) equal the local server's, exact and mapped alike, streamed or not, JSON
constrained or not; concurrent requests share batched forward passes inside the member's actor; a
killed actor fails its request with an error naming it, the server stays up and the next request is
served by the restarted actor; closing the engine leaves no actors or placement groups behind.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from orchestra.family.corpus import data_text
from orchestra.familycache import CachePolicy, FamilyCache, make_executor
from orchestra.familycache.gates import GatePolicy
from orchestra.familycache.mapping_store import MappingStore
from orchestra.pipelines.spec import ExecutorSpec
from orchestra.serve import ServeConfig, ServeEngine, create_app, free_port
from tests.waiting import HANG_GUARD_S, wait_until

ray = pytest.importorskip("ray")
uvicorn = pytest.importorskip("uvicorn")

from orchestra.familycache._ray import NAMESPACE, RemoteKV  # noqa: E402  (needs ray)
from orchestra.serve._decode import batch_stats_op  # noqa: E402

DOC = data_text("gpl-3.txt")[:260]
CORPUS = [("mpl", data_text("mpl-2.0.txt")[:6000]), ("apache", data_text("apache-2.0.txt")[:6000])]
TOKENS = 1024  # calibration tokens: the mapping's quality is not under test, its path is
GATE = GatePolicy(offline=None, probe={"tokens": 16, "max_excess_nll": 100.0})


def conversation(question: str) -> list[dict]:
    return [{"role": "system", "content": f"Answer from this licence.\n\n{DOC}"}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def mappings(tiny_serve_family, tmp_path_factory) -> Path:
    """A store with root -> finetuned calibrated offline (the ray executor never calibrates on demand)."""
    directory = tmp_path_factory.mktemp("serve_ray_maps")
    registry = tiny_serve_family.registry
    MappingStore(directory, tokens=TOKENS, corpus=CORPUS).get(registry.load("root"), registry.load("finetuned"))
    return directory


def _engine(family, directory: Path, executor) -> ServeEngine:
    config = ServeConfig(device="cpu", gate=GATE, max_batch=4)
    store = MappingStore(directory, tokens=TOKENS, corpus=CORPUS, on_missing="refuse")
    cache = FamilyCache(executor, store, source="root",
                        policy=CachePolicy(budget_bytes=config.cache_budget_bytes(), gate=config.gate,
                                           tail_tokens=config.tail_tokens))
    return ServeEngine(config, family=family.manifest, cache=cache)


class LiveApp:
    """An app served by uvicorn in a thread of its own, on a free port."""

    def __init__(self, engine: ServeEngine) -> None:
        self.engine = engine
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(engine=engine), host="127.0.0.1", port=port,
                                                    log_config=None, access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: self.server.started, what="uvicorn to start", alive=self.thread)
        self.client = OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, timeout=HANG_GUARD_S)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def local(tiny_serve_family, mappings):
    live = LiveApp(_engine(tiny_serve_family, mappings, make_executor("local", tiny_serve_family.registry)))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def remote(ray_cluster, tiny_serve_family, mappings):
    executor = make_executor("ray", tiny_serve_family.registry, ExecutorSpec(kind="ray", num_cpus=0.5, max_restarts=2),
                             name="serve-test", start=True)
    live = LiveApp(_engine(tiny_serve_family, mappings, executor))
    yield live
    live.stop()
    executor.close()


def _ask(client: OpenAI, model: str, question: str, **kw):
    raw = client.chat.completions.with_raw_response.create(model=model, messages=conversation(question),
                                                           temperature=0, **kw)
    return raw.headers, raw.parse()


def test_replies_and_cache_paths_equal_the_local_executors(local, remote):
    """Exact on root, then mapped into finetuned (on its actor): same greedy text, token counts and headers."""
    got = {}
    for name, live in (("local", local), ("ray", remote)):
        got[name] = [_ask(live.client, model, "Who may copy it?", max_tokens=24)
                     for model in ("root", "finetuned", "finetuned")]
    for (lh, lc), (rh, rc) in zip(got["local"], got["ray"], strict=True):
        assert rc.choices[0].message.content == lc.choices[0].message.content
        assert rc.usage.model_dump() == lc.usage.model_dump()
        assert rc.choices[0].finish_reason == lc.choices[0].finish_reason
        for header in ("x-orchestra-cache", "x-orchestra-cached-tokens", "x-orchestra-cache-source",
                       "x-orchestra-gates", "x-orchestra-fallback"):
            assert rh.get(header) == lh.get(header), header
    # root prefilled; finetuned mapped from root's cache (on its actor); then finetuned's mapped entry reused
    assert [h["x-orchestra-cache"] for h, _ in got["ray"]] == ["exact", "mapped", "mapped"]
    cached = [int(h["x-orchestra-cached-tokens"]) for h, _ in got["ray"]]
    assert 0 < cached[1] < cached[2] == got["ray"][2][1].usage.prompt_tokens - 1
    assert got["ray"][1][0]["x-orchestra-cache-source"] == "root"
    assert got["ray"][0][1].usage.completion_tokens == 24
    # the server's cache entries are ObjectRefs in the object store, built by the members' actors
    entries = remote.engine.cache.pool.entries()
    assert entries and all(isinstance(e.cache, RemoteKV) and isinstance(e.cache.ref, ray.ObjectRef)
                           for e in entries)
    assert {e.cache.producer for e in entries} == {"root#0", "finetuned#0"}
    assert remote.engine.cache.executor.stats()["kv_bytes_moved"] > 0  # root's cache read by finetuned's actor


def test_streamed_reply_equals_the_whole_one(remote):
    question = "What does it protect?"
    _, whole = _ask(remote.client, "root", question, max_tokens=20)
    raw = remote.client.chat.completions.with_raw_response.create(
        model="root", messages=conversation(question), temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True})
    assert raw.headers["x-orchestra-cache"] == "exact"
    chunks = list(raw.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1  # it streamed, piece by piece
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sampling_fields_and_logprobs_are_honoured_in_the_actor(local, remote):
    """Penalties, logit_bias, top_k and logprobs travel to the member's actor: the same reply and log-probabilities
    as the local executor's, streamed or not."""
    fields = {"max_tokens": 8, "frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {"100": 3.0},
              "logprobs": True, "top_logprobs": 3, "extra_body": {"repetition_penalty": 1.3}}
    got = {name: _ask(live.client, "root", "Who may change it?", **fields)[1] for name, live in
           (("local", local), ("ray", remote))}
    local_reply, ray_reply = got["local"].choices[0], got["ray"].choices[0]
    assert ray_reply.message.content == local_reply.message.content
    ray_tokens, local_tokens = ray_reply.logprobs.content, local_reply.logprobs.content
    assert [t.token for t in ray_tokens] == [t.token for t in local_tokens]
    assert [t.logprob for t in ray_tokens] == pytest.approx([t.logprob for t in local_tokens], abs=1e-4)
    assert all(len(t.top_logprobs) == 3 for t in ray_tokens)
    stream = remote.client.chat.completions.create(model="root", messages=conversation("Who may change it?"),
                                                   temperature=0, stream=True, **fields)
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in ray_tokens]
    greedy = _ask(remote.client, "root", "Who may change it?", max_tokens=8)[1]
    top1 = remote.client.chat.completions.create(model="root", messages=conversation("Who may change it?"),
                                                 max_tokens=8, temperature=1.0, extra_body={"top_k": 1})
    assert top1.choices[0].message.content == greedy.choices[0].message.content


def test_json_constraint_runs_in_the_actor(local, remote):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}):
        texts = [_ask(live.client, "root", "How many sections?", max_tokens=40, response_format=fmt)[1]
                 for live in (local, remote)]
        assert texts[0].choices[0].message.content == texts[1].choices[0].message.content
        reply = texts[1].choices[0].message.content
        # unconstrained, the tiny model writes no JSON at all (json_object allows any JSON value)
        assert reply.lstrip()[:1] in (("{", "[") if fmt["type"] == "json_object" else ("{",)), reply
        assert reply != _ask(remote.client, "root", "How many sections?", max_tokens=40)[1].choices[0].message.content
        if texts[1].choices[0].finish_reason == "stop":
            assert isinstance(json.loads(reply), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 5}}}
    with pytest.raises(openai.BadRequestError) as info:
        _ask(remote.client, "root", "Anything?", max_tokens=4, response_format=bad)
    assert info.value.body["param"] == "response_format"


def test_concurrent_requests_are_batched_in_the_actor(remote):
    executor = remote.engine.cache.executor

    def stats() -> dict[str, int]:
        return executor.stream("root", batch_stats_op, on_item=lambda item: None)

    questions = ["Who wrote it?", "May I sell it?", "Is there a warranty?", "What is source code?"]
    alone = {q: _ask(remote.client, "root", q, max_tokens=40)[1].choices[0].message.content for q in questions}
    before = stats()
    with ThreadPoolExecutor(len(questions)) as pool:
        together = dict(zip(questions, pool.map(
            lambda q: _ask(remote.client, "root", q, max_tokens=40)[1].choices[0].message.content, questions),
            strict=True))
    after = stats()
    assert together == alone  # each row sees exactly what it would alone
    steps, rows = after["steps"] - before["steps"], after["rows_stepped"] - before["rows_stepped"]
    assert steps > 0 and rows / steps > 1.2, (steps, rows)  # rows shared forward passes


def test_a_client_that_disconnects_stops_its_row_in_the_actor(remote):
    executor = remote.engine.cache.executor
    actor = executor.actors("root")[0]

    def rows() -> int:
        return executor.stream("root", batch_stats_op, on_item=lambda item: None)["rows_stepped"]

    before = rows()
    body = {"model": "root", "messages": [{"role": "user", "content": "Tell me everything about the licence."}],
            "temperature": 0, "max_tokens": 450, "stream": True}
    pieces = 0
    with httpx.stream("POST", f"{remote.base_url}/v1/chat/completions", json=body, timeout=HANG_GUARD_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                pieces += 1
            if pieces == 3:
                break  # and hang up
    # the actor's stream ends once the row has left the batch; how soon is the count below, not a time
    wait_until(lambda: not actor.busy, what="the actor to stop decoding for a client that left", poll_s=0.01)
    decoded = rows() - before
    # the prefill gives the first piece and each batch step one more; the hang-up may be seen at once
    assert pieces - 1 <= decoded < 200, decoded  # stopped a few steps after the hang-up, far from 450


def test_a_killed_actor_fails_its_request_and_the_next_one_is_served(remote):
    executor = remote.engine.cache.executor
    actor = executor.actors("finetuned")[0]
    messages = [{"role": "user", "content": "Tell me everything about the licence."}]  # short: room for 450 tokens
    ask = {"model": "finetuned", "messages": messages, "temperature": 0, "max_tokens": 450}
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in remote.client.chat.completions.create(**ask, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
                if len(received) == 2:
                    ray.kill(actor.handle, no_restart=False)
    assert "finetuned#0" in str(info.value) and "died" in str(info.value), str(info.value)
    assert 2 <= len(received) < 450

    # a non-streamed request whose actor dies: a 503 with a JSON error body naming the actor
    box: dict = {}
    asker = threading.Thread(target=lambda: box.update(response=httpx.post(
        f"{remote.base_url}/v1/chat/completions", json=ask, timeout=HANG_GUARD_S)))
    asker.start()
    restarted = executor.actors("finetuned")[0]
    # restarted, and the request is bound to it
    wait_until(lambda: not restarted.suspect and restarted.busy >= 1, what=f"the restarted actor to take the "
               f"request {box}", alive=asker, poll_s=0.01)
    # killed as soon as the call is the actor's: whether it is still loading or already decoding, the
    # request dies with it (a pause here would race the reply, which may end early at EOS)
    ray.kill(executor.actors("finetuned")[0].handle, no_restart=False)
    asker.join(120)
    response = box["response"]
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "actor_lost" and "finetuned#0" in error["message"], error

    # the server is up, and the restarted actor serves the next request (same reply as before the kills)
    assert httpx.get(f"{remote.base_url}/healthz").status_code == 200
    headers, reply = _ask(remote.client, "finetuned", "Who may copy it?", max_tokens=24)
    _, again = _ask(remote.client, "root", "Who may copy it?", max_tokens=24)
    assert reply.choices[0].message.content and again.choices[0].message.content
    assert executor.actors("finetuned")[0].suspect is False


async def test_an_adapter_and_a_quantized_view_are_served_from_actors_of_their_own(ray_cluster, tiny_serve_family,
                                                                                  tmp_path_factory):
    """`orchestra serve --adapter legal=... --quantized root-int8=root:int8 --executor ray`: each is a member with an
    actor of its own (the root's weights loaded again in it); /v1/models lists them, and the adapter reaches the
    document the root computed through the map calibrated offline, with the local server's reply."""
    import importlib.util

    from orchestra.models.modelref import AdapterSpec
    from orchestra.models.registry import ModelRegistry
    from tests.fixtures.adapters import make_lora_adapter
    from tests.orchestra.serve.conftest import asgi_client

    home = tmp_path_factory.mktemp("serve_ray_views")
    legal = make_lora_adapter(tiny_serve_family.registry.info("root").path, home / "legal", scale=0.02, seed=1)
    # the family's records with their files' fingerprints, so the map calibrated here is the one the server finds
    members = {name: record.model_copy(update={"fingerprint": tiny_serve_family.registry.info(record.role)
                                               .fingerprint_parts})
               for name, record in tiny_serve_family.manifest.members.items()}
    family = tiny_serve_family.manifest.model_copy(update={"home": str(home), "members": members})
    offline = ModelRegistry({"root": "tiny-parent", "legal": AdapterSpec(str(legal), "root")}, family=family,
                            default_device="cpu")
    MappingStore(home / "mappings", tokens=TOKENS, corpus=CORPUS).get(offline.load("root"), offline.load("legal"))
    quantized = {"root-int8": "root:int8"} if importlib.util.find_spec("torchao") is not None else {}
    settings = {"device": "cpu", "dtype": "float32", "gate": GATE, "adapters": {"legal": str(legal)}}

    replies = {}
    for kind, views in (("local", {}), ("ray", quantized)):
        executor = {"kind": kind, "address": ray_cluster, "num_cpus": 0.25}  # beside `remote`'s actors: 2 CPUs
        engine = ServeEngine(ServeConfig(**settings, quantized=views, executor=executor), family=family)
        try:
            async with asgi_client(engine) as client:
                cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
                assert (cards["legal"]["role"], cards["legal"]["parent"]) == ("adapter", "root")
                for name in views:
                    assert (cards[name]["role"], cards[name]["parent"]) == ("quantized", "root")
                got = []
                for model in ("root", "legal", *views):
                    body = {"model": model, "messages": conversation("Who may copy it?"), "max_tokens": 12,
                            "temperature": 0}
                    reply = await client.post("/v1/chat/completions", json=body)
                    assert reply.status_code == 200, reply.text
                    got.append((reply.headers["x-orchestra-cache"], reply.json()["choices"][0]["message"]["content"]))
                replies[kind] = got
            if kind == "ray":
                actors = engine.cache.executor.placement()
                assert sorted(actors) == sorted(["root", "finetuned", "legal", *views])
        finally:
            engine.close()
    # the adapter's reply was decoded in its actor from the root's cache, mapped there: as the local server's
    assert replies["ray"][:2] == replies["local"] and replies["ray"][1][0] == "mapped"
    assert all(text for _, text in replies["ray"])


def test_closing_the_engine_leaves_no_actors_or_groups(ray_cluster, tiny_serve_family):
    """An engine built from its config (as `orchestra serve` builds it) starts its actors before it serves,
    and closing it (what the command does after uvicorn's shutdown on SIGTERM) removes them and their group."""
    config = ServeConfig(device="cpu", executor={"kind": "ray", "address": ray_cluster, "num_cpus": 0.5})
    engine = ServeEngine(config, family=tiny_serve_family.manifest)
    executor = engine.cache.executor
    assert engine.remote and executor.kind == "ray"
    name = f"orchestra.serve.{executor.uid}."
    assert sorted(a["name"] for a in _ours() if a["name"].startswith(name)) == [f"{name}finetuned.0", f"{name}root.0"]
    assert f"orchestra-serve-{executor.uid}" in _live_groups()
    engine.close()
    engine.close()  # idempotent
    assert not [a for a in _ours() if a["name"].startswith(name)]
    assert f"orchestra-serve-{executor.uid}" not in _live_groups()
    assert ray.is_initialized()  # a Ray the server joined is not its to stop


def _ours() -> list[dict]:
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]


def _live_groups() -> list[str]:
    return [pg["name"] for pg in ray.util.placement_group_table().values()
            if pg["name"].startswith("orchestra-") and pg["state"] != "REMOVED"]
