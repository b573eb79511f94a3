"""The scheduler on the real SmolLM2 family: one source prefill, mapped caches elsewhere, gates."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestra.family.corpus import data_text
from orchestra.familycache.mapping_store import MappingStore
from orchestra.pipelines.spec import PipelineSpec
from orchestra.runs.scheduler import Orchestra

pytestmark = pytest.mark.real_model

DOC = data_text("gpl-3.txt")[:2400]


def _agent(name, model, task, upstream=()):
    return {"name": name, "model": model, "upstream": list(upstream),
            "spec": {"role": "You answer briefly.", "task": task,
                     "generation": {"max_new_tokens": 12, "temperature": 0.0}}}


async def test_prefill_once_map_to_members_and_match_exact_baseline(real_family):
    pipe = PipelineSpec.model_validate({
        "name": "real", "models": {"root": "root", "tuned": "finetuned"},
        "source": "root", "default_device": "cpu",
        "agents": [
            _agent("what", "root", "What is this document? One sentence."),
            _agent("who", "tuned", "Who publishes this licence?"),
            _agent("join", "root", "Combine: {who}", upstream=["who"]),
        ],
        "gate": {"offline": {"max_kl": 1.0}, "probe": {"tokens": 16, "max_excess_nll": 1.0, "max_excess_kl": 0.5}},
        "mapping": {"tail_tokens": 16},
    })
    # the family's own root -> finetuned map (the real_family fixture makes sure it exists); never written to
    maps = MappingStore(Path(real_family.home) / "mappings", on_missing="refuse")
    orch = Orchestra(pipe, family=real_family, mappings=maps)
    report = await orch.run(DOC)

    assert report.succeeded == ["what", "who", "join"], [(a.name, a.error) for a in report.agents]
    prefills = [c for c in report.caches if c.path == "exact"]
    assert [c.model for c in prefills] == ["root"]  # the document was prefilled once, on the source
    for name in ("who",):
        agent = report.agent(name)
        assert agent.cache_path in {"mapped", "reprefilled"}
        assert {g["gate"] for g in agent.gate} == {"offline", "probe"}
        assert (agent.cache_path == "reprefilled") == (agent.fallback_reason is not None)
    mapped = [c for c in report.caches if c.path == "mapped"]
    assert all(c.mapping and c.tail_tokens == 16 for c in mapped)

    baseline = await Orchestra(pipe, family=real_family, mappings=maps, share_prefill=False).run(DOC)
    # exact caches give exactly the re-prefill outputs under greedy decoding
    assert report.agent("what").output == baseline.agent("what").output
    for name in ("who",):
        if report.agent(name).cache_path == "reprefilled":
            assert report.agent(name).output == baseline.agent(name).output


async def test_an_agent_with_the_find_tool_reports_its_calls_as_events_over_the_shared_document(real_family):
    pipe = PipelineSpec.model_validate({
        "models": {"root": "root"}, "source": "root", "default_device": "cpu", "kv_store": {"enabled": False},
        "agents": [{"name": "answer", "model": "root", "spec": {
            "task": "Who may copy the licence? Look it up first.", "tools": ["agents.tools:find"],
            "tool_choice": "required", "max_tool_rounds": 1, "generation": {"max_new_tokens": 48}}}]})
    maps = MappingStore(Path(real_family.home) / "mappings", on_missing="refuse")
    events = []
    report = await Orchestra(pipe, family=real_family, mappings=maps).run(DOC, on_event=events.append)
    answer = report.agent("answer")
    assert answer.status in ("succeeded", "degenerate") and answer.cache_path == "exact"
    calls, results = ([e for e in events if e.kind == kind] for kind in ("tool_call", "tool_result"))
    assert len(calls) == len(results) == len(answer.tool_calls) == 1  # required, then only the answer
    for call, result, recorded in zip(calls, results, answer.tool_calls, strict=True):
        assert call.tool == result.tool == recorded["name"] and result.result == recorded["result"]
        assert result.seconds >= 0 and call.round == 0
