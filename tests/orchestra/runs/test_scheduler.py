from __future__ import annotations

import pytest
import torch

from orchestra.errors import CrossFamilyError, DocumentError, PipelineError, UnknownModelError
from orchestra.family.corpus import data_text
from orchestra.familycache.mapping_store import MappingStore
from orchestra.observability.events import (
    AgentFailed,
    AgentSkipped,
    Fallback,
    GateResult,
    RunFinished,
    TokenEvent,
)
from orchestra.pipelines.spec import PipelineSpec
from orchestra.runs.scheduler import Orchestra

DOC = data_text("gpl-3.txt")[:320]


def _spec(name, model, upstream=(), task="Summarise the document.", **gen):
    return {"name": name, "model": model, "upstream": list(upstream),
            "spec": {"role": "You are careful.", "task": task,
                     "generation": {"max_new_tokens": gen.get("max_new_tokens", 8), "temperature": 0.0}}}


def _pipeline(fam, agents, **extra) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "name": "t", "models": {"base": str(fam.parent), "child": str(fam.child), "base2": str(fam.parent)},
        "source": "base", "default_device": "cpu", "agents": agents, **extra,
    })


async def test_prefill_once_fan_out_and_store_hit(fam, mapstore):
    pipe = _pipeline(fam, [
        _spec("a", "base"), _spec("b", "child"), _spec("c", "base2", upstream=["a"], task="Improve: {a}"),
    ], gate={"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0}})
    orch = Orchestra(pipe, mappings=mapstore)
    events = []
    report = await orch.run(DOC, on_event=events.append)
    assert report.succeeded == ["a", "b", "c"]
    paths = {r.name: r.cache_path for r in report.agents}
    assert paths == {"a": "exact", "b": "mapped", "c": "exact"}  # base2 is the same weights: exact reuse
    prefilled = [c for c in report.caches if c.path in {"exact", "reprefilled"}]
    assert len(prefilled) == 1 and prefilled[0].model == "base"  # the document was prefilled once
    assert any(isinstance(e, TokenEvent) and e.agent == "b" for e in events)
    assert isinstance(events[-1], RunFinished)
    gate = [e for e in events if isinstance(e, GateResult)]
    assert [g.agent for g in gate] == ["b"] and gate[0].passed and "excess_nll" in gate[0].metrics
    assert report.agent("b").ttft_s is not None and report.agent("b").prefill_s_saved > 0

    again = await orch.run(DOC)  # same document: exact and mapped caches come from the store
    assert again.store_hits >= 2
    assert all(c.store_hit for c in again.caches)
    assert [a.output for a in again.agents] == [a.output for a in report.agents]


def _bad_mapping(mapping):
    from mappings.apply import LayerMap

    gen = torch.Generator().manual_seed(0)
    layers = []
    for i, _layer in enumerate(mapping.kv_map.layers):
        width = mapping.kv_map.target_shape.width
        w = torch.randn(width, width, generator=gen) * 3
        layers.append(LayerMap((i,), "map", k_weight=w, v_weight=w.clone()))
    mapping.kv_map.layers = layers
    return mapping


async def test_bad_mapping_falls_back_and_matches_reprefill(fam, mapstore, tmp_path):
    pipe = _pipeline(fam, [_spec("b", "child", max_new_tokens=12)],
                     gate={"offline": None, "probe": {"tokens": 16, "max_excess_nll": 0.5}})
    good = Orchestra(pipe, mappings=mapstore)
    source, target = good.registry.load("base"), good.registry.load("child")
    mapping, _ = mapstore.get(source, target)

    bad_store = MappingStore(tmp_path, corpus=mapstore.corpus, tokens=2048)
    bad_store._cache[(source.info.fingerprint, target.info.fingerprint)] = _bad_mapping(
        type(mapping)(mapping.kv_map.__class__(**{**mapping.kv_map.__dict__}), mapping.manifest, None, None))
    bad_store._probe.update(mapstore._probe)
    orch = Orchestra(pipe, mappings=bad_store)
    events = []
    report = await orch.run(DOC, on_event=events.append)
    agent = report.agent("b")
    assert agent.cache_path == "reprefilled"
    assert "probe gate failed" in agent.fallback_reason
    assert any(isinstance(e, Fallback) for e in events)
    metrics = agent.gate[0]["metrics"]
    assert not agent.gate[0]["passed"] and (metrics["excess_nll"] > 0.5 or metrics["excess_kl"] > 0.1)

    baseline = await Orchestra(pipe, mappings=mapstore, share_prefill=False).run(DOC)
    assert agent.output == baseline.agent("b").output


async def test_failing_agent_skips_dependents_only(fam, mapstore):
    agents = [
        _spec("ok", "base"),
        {**_spec("slow", "child", max_new_tokens=50), "timeout_s": 0.001},
        _spec("after", "base", upstream=["slow"], task="Use {slow}"),
    ]
    events = []
    report = await Orchestra(_pipeline(fam, agents), mappings=mapstore).run(DOC, on_event=events.append)
    assert report.agent("ok").status == "succeeded"
    assert report.agent("slow").status == "failed" and report.agent("slow").error_type == "TimeoutError"
    assert report.agent("after").status == "skipped" and "slow" in report.agent("after").skip_reason
    assert any(isinstance(e, AgentFailed) for e in events) and any(isinstance(e, AgentSkipped) for e in events)


async def test_an_agent_may_run_on_the_upstreams_that_succeeded_saying_which_it_lacks(fam, mapstore):
    agents = [
        _spec("ok", "base"),
        {**_spec("slow", "child", max_new_tokens=50), "timeout_s": 0.001},
        {**_spec("joined", "base", upstream=["ok", "slow"], task="Combine {ok} and {slow}"),
         "on_upstream_failure": "run_with_available"},
        _spec("strict", "base", upstream=["ok", "slow"], task="Combine {ok} and {slow}"),
        {**_spec("alone", "base", upstream=["slow"], task="Use {slow}"), "on_upstream_failure": "run_with_available"},
    ]
    seen: dict[str, object] = {}
    orch = Orchestra(_pipeline(fam, agents), mappings=mapstore)
    generate = orch.cache.executor.generate

    async def spy(member, spec, **kwargs):
        seen[spec.name] = dict(kwargs["upstream"])
        return await generate(member, spec, **kwargs)

    orch.cache.executor.generate = spy  # the real generation, its upstream values recorded
    report = await orch.run(DOC)
    assert report.agent("joined").status == "succeeded"
    assert set(report.agent("joined").missing_upstreams) == {"slow"}
    assert "did not succeed" in report.agent("joined").missing_upstreams["slow"]
    assert seen["joined"]["ok"] == report.agent("ok").output
    assert str(seen["joined"]["slow"]).startswith("(not available: upstream slow did not succeed")
    assert report.agent("strict").status == "skipped"  # the default still skips
    assert report.agent("alone").status == "skipped"  # nothing available: nothing to run on


async def test_stream_yields_typed_events(fam, mapstore):
    orch = Orchestra(_pipeline(fam, [_spec("a", "base")]), mappings=mapstore)
    kinds = [event.kind async for event in orch.stream(DOC)]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished"
    assert "token" in kinds and "agent_finished" in kinds
    assert orch.last_report is not None and orch.last_report.succeeded == ["a"]


async def test_bad_documents(fam, mapstore):
    # chunking.mode never: a document longer than the context is refused (auto chunks it: test_chunking.py)
    orch = Orchestra(_pipeline(fam, [_spec("a", "base")], chunking={"mode": "never"}), mappings=mapstore)
    with pytest.raises(DocumentError, match="empty"):
        await orch.run("   ")
    with pytest.raises(DocumentError, match="takes at most 512"):
        await orch.run(data_text("gpl-3.txt"))


def test_invalid_pipelines_refused_before_loading(fam, tmp_path):
    with pytest.raises(UnknownModelError, match="neither a family member"):
        Orchestra(PipelineSpec.model_validate({"models": {"m": str(tmp_path)}, "agents": [_spec("a", "m")]}))
    # what a task template reads is an upstream: no need to write it twice
    spec = _pipeline(fam, [_spec("a", "base"), _spec("b", "base", task="use {a}")])
    assert spec.agent("b").upstream == ["a"]
    with pytest.raises(PipelineError, match="not an agent of this pipeline"):
        _pipeline(fam, [_spec("a", "base"), _spec("b", "base", task="use {c}")])


def test_other_family_is_refused(fam, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.tiny_family import make_tokenizer

    other = tmp_path / "other"
    AutoModelForCausalLM.from_pretrained(fam.parent).save_pretrained(other)
    make_tokenizer(vocab_size=300).save_pretrained(other)
    pipe = PipelineSpec.model_validate({"models": {"base": str(fam.parent), "other": str(other)},
                                        "source": "base", "agents": [_spec("a", "base"), _spec("b", "other")]})
    with pytest.raises(CrossFamilyError, match="member other's tokenizer differs from the source's .*vocabulary 300 vs 320"):
        Orchestra(pipe)


async def test_shadow_failures_trip_the_breaker(fam, mapstore):
    from orchestra.familycache.gates import CircuitBreaker

    gate = {"offline": None, "probe": None,
            "shadow": {"probability": 1.0, "max_kl": 0.0, "window": 5, "trip_after": 1, "cooldown_s": 3600}}
    pipe = _pipeline(fam, [_spec("b", "child")], gate=gate)
    breaker = CircuitBreaker()
    first = await Orchestra(pipe, mappings=mapstore, breaker=breaker).run(DOC)
    agent = first.agent("b")
    assert agent.cache_path == "reprefilled" and "shadow gate failed" in agent.fallback_reason
    assert agent.gate[0]["gate"] == "shadow" and "breaker opened" in agent.gate[0]["reason"]
    second = await Orchestra(pipe, mappings=mapstore, breaker=breaker).run(DOC)
    assert second.agent("b").fallback_reason == "circuit breaker open for this pair after shadow failures"
    assert second.agent("b").gate == []  # the map was not even tried


def test_run_command_writes_report(fam, tmp_path):
    import json

    from typer.testing import CliRunner

    from orchestra.cli import app

    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        f"models: {{base: '{fam.parent}', child: '{fam.child}'}}\nsource: base\ndefault_device: cpu\n"
        f"mapping: {{directory: '{tmp_path / 'maps'}', tokens: 1024}}\n"
        "gate: {offline: null, probe: {tokens: 8, max_excess_nll: 100, max_excess_kl: 100}}\n"
        "agents:\n"
        "  - {name: a, model: base, spec: {task: Summarise., generation: {max_new_tokens: 4}}}\n"
        "  - {name: b, model: child, upstream: [a], spec: {task: 'Check {a}', generation: {max_new_tokens: 4}}}\n"
    )
    document = tmp_path / "doc.txt"
    document.write_text(DOC)
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["run", str(pipeline), "--document", str(document), "--report", str(out),
                                      "--home", str(tmp_path / "nohome")])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [a["status"] for a in report["agents"]] == ["succeeded", "succeeded"]
    assert report["agents"][1]["cache_path"] == "mapped" and report["warnings"]  # calibrated on demand, said so
    assert "prefill seconds spent" in result.output

    missing = CliRunner().invoke(app, ["run", str(pipeline), "--document", str(tmp_path / "none.txt")])
    assert missing.exit_code == 2 and "does not exist" in missing.output


async def test_repair_policy_repairs_mapped_caches_and_reports_it(fam, mapstore):
    """With `mapping.repair`, the mapped cache is repaired (tokens), the plan is reported, and a repaired
    cache is a different store entry from a pure-mapped one; layer repair without residual maps degrades to
    token repair with a warning."""
    from mappings import cache_layers

    agents = [_spec("a", "base"), _spec("b", "child")]
    gate = {"offline": None, "probe": None}
    plain = Orchestra(_pipeline(fam, agents, gate=gate), mappings=mapstore)
    await plain.run(DOC)
    repaired = Orchestra(_pipeline(fam, agents, gate=gate, mapping={"repair": {"budget": 0.25, "layer_share": 0.5},
                                                                         "repair_costs": "compute"}),
                         mappings=mapstore)
    events = []
    report = await repaired.run(DOC, on_event=events.append)
    child = next(c for c in report.caches if c.model == "child")
    assert child.path == "mapped" and child.repair is not None
    assert child.repair["tokens"] > 0 and child.repair["blocks"] == []
    assert any("layer repair skipped" in w for w in report.warnings)
    ready = [e for e in events if getattr(e, "kind", "") == "cache_ready" and e.model == "child"]
    assert ready and ready[0].repair == child.repair
    # the repaired cache is its own entry (another namespace) and differs from the pure map where tokens were
    # recomputed (both have exact sinks: the cache's default)
    rep = next(e for e in repaired.cache.pool.entries() if e.namespace.kind == "mapped")
    pure = next(e for e in plain.cache.pool.entries() if e.namespace.kind == "mapped")
    assert rep.namespace != pure.namespace
    rep_layers, map_layers = cache_layers(rep.cache), cache_layers(pure.cache)
    assert torch.allclose(rep_layers[0][0][..., :4, :], map_layers[0][0][..., :4, :], atol=1e-5)
    assert not torch.allclose(rep_layers[0][0], map_layers[0][0])


async def test_an_agent_that_asks_for_repair_reads_a_repaired_map_and_the_others_share_the_pure_one(fam, mapstore):
    """The question answerer's own `mapped_repair` repairs the mapped cache it reads, a node's `repair` overrides
    an agent's, and agents that ask for nothing read the pipeline's pure map: one entry per repair asked for."""
    from agents.builtin import QA_REPAIR

    qa = {"builtin": "question_answerer", "args": {"question": "Who may copy it?", "max_new_tokens": 4}}
    agents = [_spec("a", "child"), _spec("b", "child"), {"name": "ask", "model": "child", **qa},
              {"name": "cheap", "model": "child", "repair": {"budget": 0.1}, **qa}]
    orch = Orchestra(_pipeline(fam, agents, gate={"offline": None, "probe": None},
                               mapping={"repair_costs": "compute"}), mappings=mapstore)
    report = await orch.run(DOC)
    assert report.succeeded == ["a", "b", "ask", "cheap"]
    mapped = [c for c in report.caches if c.model == "child"]
    assert all(c.path == "mapped" for c in mapped)
    policies = sorted((c.repair or {}).get("policy", {}).get("budget", 0.0) for c in mapped)
    assert policies == [0.0, 0.1, QA_REPAIR.budget]  # a and b share the pure map; each repair is its own entry
    asked = next(c.repair for c in mapped if c.repair and c.repair["policy"]["budget"] == QA_REPAIR.budget)
    assert asked["scattered"] > 0 and asked["cost"] <= QA_REPAIR.budget  # interior tokens the source reads


async def test_a_question_focused_repair_ranks_each_agents_map_by_its_own_question(fam, mapstore):
    """`repair: {focus: question}`: the agent's own suffix ranks the interior tokens recomputed, so two questions
    read two repaired entries, and an agent asking the same question shares the first's."""
    from transformers import AutoTokenizer

    from agents import suffix_ids

    repair = {"budget": 0.5, "scattered_share": 1.0, "focus": "question"}

    def qa(name: str, question: str) -> dict:
        return {"name": name, "model": "child", "repair": repair,
                "builtin": "question_answerer", "args": {"question": question, "max_new_tokens": 4}}

    agents = [qa("who", "Who may copy it?"), qa("when", "When was it published?"), qa("again", "Who may copy it?")]
    orch = Orchestra(_pipeline(fam, agents, gate={"offline": None, "probe": None},
                               mapping={"repair_costs": "compute"}), mappings=mapstore)
    report = await orch.run(DOC)
    assert report.succeeded == ["who", "when", "again"]
    tok = AutoTokenizer.from_pretrained(fam.child)
    mapped = [c for c in report.caches if c.model == "child"]
    assert all(c.path == "mapped" and c.repair and c.repair["scattered"] > 0 for c in mapped)
    focuses = sorted({tuple(c.repair["policy"]["focus"]) for c in mapped})  # type: ignore[index]
    # the agents' own questions rank: two questions, two focuses (the third agent asks the first's)
    assert focuses == sorted({tuple(suffix_ids(tok, orch.specs[n])) for n in ("who", "when")})
    assert len([e for e in orch.cache.pool.entries() if e.namespace.kind == "mapped"]) == 2


async def test_the_answer_gate_reruns_an_agent_whose_mapped_answer_strays_from_the_sources(fam, mapstore):
    """`gate: {answer: ...}`: after the agent answers on a mapped cache, the root answers too; an answer too far
    from the root's is replaced by the agent's answer on a re-prefill, with the gate's reading and the fallback
    in the events and the report. A threshold every answer meets keeps the mapped one."""
    from orchestra.observability.events import Fallback, GateResult, TokenEvent

    agents = [_spec("a", "child", max_new_tokens=6)]
    strict = {"offline": None, "probe": None, "answer": {"tokens": 6, "min_f1": 1.0}}
    events: list = []
    report = await Orchestra(_pipeline(fam, agents, gate=strict), mappings=mapstore).run(DOC, on_event=events.append)
    a = report.agent("a")
    answer = next(g for g in a.gate if g["gate"] == "answer")
    assert answer["metrics"]["answer_f1"] < 1.0, "the tiny child answered word for word as the root: change the task"
    assert not answer["passed"] and a.cache_path == "reprefilled" and a.fallback_reason.startswith("answer gate")
    gate_events = [e for e in events if isinstance(e, GateResult) and e.agent == "a"]
    assert gate_events[-1].passed is False and "answer_f1" in gate_events[-1].metrics
    fallback = next(e for e in events if isinstance(e, Fallback) and e.agent == "a")
    assert fallback.reason == a.fallback_reason and events.index(fallback) > events.index(gate_events[-1])
    # the FamilyCache handed out the member's own prefill: the run holds it beside the refused mapped cache
    assert {c.path for c in report.caches if c.model == "child"} == {"mapped", "reprefilled"}
    own = await Orchestra(_pipeline(fam, agents, gate={"force_reprefill": True}), mappings=mapstore).run(DOC)
    assert a.output == own.agent("a").output  # the answer kept is the one on the member's own prefill
    # only the kept answer streams: its tokens come after the gate's verdict, once, the dropped one never
    at = {id(e): i for i, e in enumerate(events)}
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.agent == "a"]
    assert tokens and all(at[id(e)] > at[id(gate_events[-1])] for e in tokens)
    assert [e.index for e in tokens] == list(range(len(tokens))) and len(tokens) == a.tokens

    lenient = {"offline": None, "probe": None, "answer": {"tokens": 6, "min_f1": 0.0}}
    events.clear()
    kept = (await Orchestra(_pipeline(fam, agents, gate=lenient), mappings=mapstore).run(DOC,
                                                                                          on_event=events.append)).agent("a")
    verdict = next(e for e in events if isinstance(e, GateResult) and e.agent == "a" and "answer_f1" in e.metrics)
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.agent == "a"]
    at = {id(e): i for i, e in enumerate(events)}
    assert tokens and at[id(tokens[0])] > at[id(verdict)]  # held until kept, then released
    assert len(tokens) == kept.tokens
    pure = (await Orchestra(_pipeline(fam, agents, gate={"offline": None, "probe": None}),
                            mappings=mapstore).run(DOC)).agent("a")
    assert kept.cache_path == "mapped" and next(g for g in kept.gate if g["gate"] == "answer")["passed"]
    assert kept.output == pure.output  # a passed answer is the mapped one, untouched


async def test_degenerate_output_is_reported_and_never_passed_downstream(fam, mapstore):
    from transformers import AutoTokenizer

    from orchestra.observability.events import AgentDegenerate

    tok = AutoTokenizer.from_pretrained(fam.parent)
    # a stop string for every character a token can start with: whatever "a" generates is cut to ''
    starts = sorted({text[0] for i in range(len(tok)) if (text := tok.decode([i]))})
    blank = _spec("a", "base")
    blank["spec"]["generation"]["stop"] = starts
    pipe = _pipeline(fam, [blank, _spec("b", "base", upstream=["a"], task="Improve: {a}"), _spec("c", "base")])
    events = []
    report = await Orchestra(pipe, mappings=mapstore).run(DOC, on_event=events.append)
    a, b = report.agent("a"), report.agent("b")
    assert a.status == "degenerate" and a.degenerate_reason.startswith("empty") and a.output == ""
    assert b.status == "skipped" and "upstream a produced degenerate output (empty" in b.skip_reason
    assert report.agent("c").status == "succeeded" and report.degenerate == ["a"]
    assert [e.agent for e in events if isinstance(e, AgentDegenerate)] == ["a"]
    assert events[-1].degenerate == ["a"] and not any(isinstance(e, AgentSkipped) and e.agent == "c" for e in events)
