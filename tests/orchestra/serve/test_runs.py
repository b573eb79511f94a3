"""Pipeline runs over HTTP on the tiny family: start, follow as SSE from the start, status and report, cancel."""

from __future__ import annotations

import json

from orchestra.family.corpus import data_text
from tests.orchestra.serve.conftest import finish_run
from tests.orchestra.serve.test_app import assert_openai_error

DOC = data_text("gpl-3.txt")[:300]
SPEC = {"models": {"r": "root", "f": "tiny-child"}, "source": "r",
        "agents": [{"name": "summary", "model": "r", "spec": {"task": "Summarise.", "generation": {"max_new_tokens": 3}}},
                   {"name": "check", "model": "f", "spec": {"task": "Check {summary}",
                                                            "generation": {"max_new_tokens": 3}}}]}


def _sse(text: str) -> list[tuple[str, dict]]:
    frames = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        frames.append((lines["event"], json.loads(lines["data"])))
    return frames


async def test_a_run_started_over_http_streams_its_events_and_reports(runs_client):
    started = await runs_client.post("/v1/runs", json={"spec": SPEC, "document": DOC})
    assert started.status_code == 201, started.text
    run = started.json()
    assert run["object"] == "pipeline.run" and run["status"] == "running" and run["pipeline"] == "inline"
    status = await finish_run(runs_client, run["id"])
    assert status["status"] == "succeeded" and status["report"]["run_id"] == run["id"]
    assert {a["name"]: a["model"] for a in status["report"]["agents"]} == {"summary": "root", "check": "finetuned"}
    events = await runs_client.get(f"/v1/runs/{run['id']}/events")  # replayed from the start after the end
    assert events.headers["content-type"].startswith("text/event-stream")
    frames = _sse(events.text)
    kinds = [kind for kind, _ in frames]
    assert kinds[0] == "run_started" and kinds[-2] == "run_finished" and kinds[-1] == "end"
    assert frames[-2][1]["report"]["agents"][0]["name"] == "summary" and frames[-1][1]["status"] == "succeeded"
    again = await runs_client.post("/v1/runs", json={"spec": SPEC, "document": DOC})
    second = await finish_run(runs_client, again.json()["id"])
    assert all(c["store_hit"] for c in second["report"]["caches"])  # the server's cache: nothing prefilled again
    assert_openai_error(await runs_client.delete(f"/v1/runs/{run['id']}"), 409, "run_finished")


async def test_a_named_pipeline_runs_with_its_inputs_and_mistakes_are_400(runs_client):
    started = await runs_client.post("/v1/runs", json={"pipeline": "qa", "document": DOC, "inputs": {"question": "Who?"}})
    status = await finish_run(runs_client, started.json()["id"])
    assert status["report"]["inputs"] == {"question": "Who?"}
    assert_openai_error(await runs_client.post("/v1/runs", json={"pipeline": "qa", "document": DOC}), 400,
                        param="inputs")
    error = assert_openai_error(await runs_client.post("/v1/runs", json={"pipeline": "nope", "document": DOC}), 400)
    assert "has qa" in error["message"]
    assert_openai_error(await runs_client.post("/v1/runs", json={"pipeline": "qa", "spec": SPEC, "document": DOC}), 400)
    folder = {**SPEC, "models": {"r": "/some/folder/model", "f": "finetuned"}}
    error = assert_openai_error(await runs_client.post("/v1/runs", json={"spec": folder, "document": DOC}), 400)
    assert "not a member of this server's family" in error["message"]
    assert_openai_error(await runs_client.post("/v1/runs", json={"spec": {"agents": []}, "document": DOC}), 400)
    assert_openai_error(await runs_client.get("/v1/runs/nosuchrun"), 404, "run_not_found")
    assert_openai_error(await runs_client.get("/v1/runs/nosuchrun/events"), 404, "run_not_found")


async def test_a_running_pipeline_is_cancelled_by_delete(runs_client):
    long = {**SPEC, "agents": [{"name": "story", "model": "r", "spec": {
        "task": "Tell a very long story.", "generation": {"max_new_tokens": 400}}}]}
    run = (await runs_client.post("/v1/runs", json={"spec": long, "document": DOC})).json()
    cancelled = await runs_client.delete(f"/v1/runs/{run['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    frames = _sse((await runs_client.get(f"/v1/runs/{run['id']}/events")).text)
    assert frames[-1] == ("end", {"id": run["id"], "status": "cancelled", "error": "cancelled by DELETE /v1/runs/{id}"})


def _samples(text: str, name: str) -> dict[str, float]:
    """`name`'s samples in a Prometheus text exposition: their label string -> value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            out[labels[len(name):]] = float(value)
    return out


async def test_runs_are_counted_in_the_servers_metrics(runs_client):
    before = _samples((await runs_client.get("/metrics")).text, "orchestra_pipeline_runs_total")
    run = (await runs_client.post("/v1/runs", json={"spec": SPEC, "document": DOC})).json()
    assert (await finish_run(runs_client, run["id"]))["status"] == "succeeded"
    text = (await runs_client.get("/metrics")).text
    runs = _samples(text, "orchestra_pipeline_runs_total")
    key = '{pipeline="inline",status="succeeded"}'
    assert runs[key] == before.get(key, 0.0) + 1
    paths = _samples(text, "orchestra_pipeline_cache_paths_total")
    assert any('model_name="root"' in k for k in paths) and any('model_name="finetuned"' in k for k in paths)
    agents = _samples(text, "orchestra_pipeline_agents_total")
    assert agents['{pipeline="inline",status="succeeded"}'] >= 2
    assert _samples(text, "orchestra_pipeline_agent_ttft_seconds_count")
    assert _samples(text, "orchestra_pipeline_run_seconds_count")['{pipeline="inline"}'] >= 1
