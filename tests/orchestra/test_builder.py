"""The Python builder `orchestra.Pipeline`: as strong as a YAML file, checked as each agent is added.

Everything but the last test runs without a model (a stand-in Orchestra records what the builder asks
of it); the last runs one three-agent pipeline, written in Python only, on the bundled family and
compares it with the same pipeline written as YAML.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from agents import AgentSpec
from orchestra import Pipeline
from orchestra.errors import (
    CycleError,
    EventLoopRunningError,
    FamilyError,
    PipelineError,
    PipelineValidationError,
    UnknownAgentError,
)
from orchestra.family import FamilyManifest, MemberRecord
from orchestra.familycache.gates import GatePolicy

YAML = """
name: three
models: {root: root, finetuned: finetuned, distilled: distilled}
source: root
mapping: {directory: MAPS, on_missing: refuse}  # the twin test reads the family's maps, calibrates none
agents:
  - name: summarizer
    model: root
    builtin: summarizer
    args: {max_words: 40, max_new_tokens: 24}
  - name: key_facts
    model: finetuned
    builtin: key_facts
    args: {max_facts: 2, max_new_tokens: 24, max_repairs: 0}
  - name: summarizer_critic
    model: distilled
    builtin: critic
    args: {target_agent: summarizer, max_new_tokens: 24}
"""


def three(maps: str = "MAPS", **options) -> Pipeline:
    """The YAML pipeline above, in Python."""
    return (
        Pipeline("three", mapping={"directory": maps, "on_missing": "refuse"}, **options)
        .agent("summarizer", model="root", max_words=40, max_new_tokens=24)
        .agent("key_facts", model="finetuned", max_facts=2, max_new_tokens=24, max_repairs=0)
        .agent("critic", model="distilled", target_agent="summarizer", max_new_tokens=24)
    )


class FakeOrchestra:
    """Stands in for orchestra.runs.scheduler.Orchestra: records its construction and replays two events."""

    made: list[FakeOrchestra] = []

    def __init__(self, spec, *, family=None, checkpointer=None) -> None:
        self.spec, self.family, self.runs, self.last_report = spec, family, [], None
        FakeOrchestra.made.append(self)

    async def run(self, document, *, on_event=None, inputs=None, run_id=None, resume=False):
        for event in ("run_started", "run_finished"):
            if on_event is not None:
                result = on_event(event)
                if result is not None:
                    await result
        self.runs.append(document)
        self.last_report = SimpleNamespace(document=document, orchestra=self)
        return self.last_report

    async def stream(self, document, *, inputs=None, run_id=None, resume=False):
        for event in ("run_started", "run_finished"):
            yield event
        self.runs.append(document)
        self.last_report = SimpleNamespace(document=document, orchestra=self)


@pytest.fixture
def fake_orchestra(monkeypatch):
    import orchestra.runs.scheduler

    FakeOrchestra.made = []
    monkeypatch.setattr(orchestra.runs.scheduler, "Orchestra", FakeOrchestra)
    return FakeOrchestra


def _family(tmp_path) -> FamilyManifest:
    def member(name, role):
        return MemberRecord(name=name, role=role, path=str(tmp_path / name), fingerprint={"combined": name},
                            num_layers=2, num_parameters=1, bytes=1)

    return FamilyManifest(home=str(tmp_path), members={
        "base": member("base", "root"), "tuned": member("tuned", "finetuned"), "mine": member("mine", "external")})


# -- building ---------------------------------------------------------------------------------------------------

def test_builder_makes_the_same_spec_as_the_yaml_file(tmp_path):
    path = tmp_path / "three.yaml"
    path.write_text(YAML)
    p = three()
    assert p.spec == Pipeline.from_file(path).spec  # field for field, agent specs included
    assert p.spec.upstreams() == {"summarizer": [], "key_facts": [], "summarizer_critic": ["summarizer"]}
    assert p.spec.models == {"root": "root", "finetuned": "finetuned", "distilled": "distilled"}  # the used roles
    assert p.models == {"root": "root", "finetuned": "finetuned", "quantized": "quantized", "distilled": "distilled",
                        "int8": "int8"}
    from orchestra.cli import app

    drawn = CliRunner().invoke(app, ["graph", str(path)])
    assert drawn.exit_code == 0 and p.graph() == drawn.output
    assert "a_summarizer --> a_summarizer_critic" in p.graph()


def test_agent_returns_the_pipeline_and_fills_names_and_upstreams():
    review = AgentSpec(name="review", task="Check {summary}")
    p = Pipeline("p", models={"tuned": "finetuned", "mine": str(Path("/models/mine"))})
    assert p.agent("summarizer", name="summary") is p
    p.agent(review, model="tuned").agent({"task": "Merge {summary} and {review}"}, name="merge", after=["facts"])
    p.agent("key_facts", name="facts", model="mine").agent("question_answerer", question="Who?", after="facts")
    assert [a.name for a in p.agents] == ["summary", "review", "merge", "facts", "answer"]
    assert p.spec.upstreams() == {"summary": [], "review": ["summary"], "merge": ["summary", "review", "facts"],
                                  "facts": [], "answer": ["facts"]}
    assert p.spec.agent("review").agent_spec() is review
    assert p.spec.models == {"root": "root", "tuned": "finetuned", "mine": "/models/mine"}
    again = Pipeline.from_spec(p.spec)
    assert again.spec is p.spec and again.to_spec() == p.spec and again.models == p.spec.models


def test_settings_are_typed_and_kept(tmp_path):
    family = _family(tmp_path)
    p = Pipeline("p", family=family, gate={"probe": {"tokens": 8}}, default_device="cpu", store_budget_mb=64)
    assert p.models == {"root": "root", "finetuned": "finetuned", "mine": "mine"}  # the given family's roles
    assert p.agent("summarizer").spec.gate.probe.tokens == 8 and p.spec.store_budget_mb == 64
    with pytest.raises(PipelineValidationError, match="field source: source 'tuned'"):
        Pipeline("p", "tuned", family=family)
    p = Pipeline("p", "tuned", family=family, models={"tuned": "finetuned"}, gate=GatePolicy(probe=None),
                 devices={"tuned": "cpu"}, dtype="bfloat16")
    spec = p.agent("summarizer", model="tuned").spec
    assert spec.source_alias == "tuned" and spec.gate.probe is None and spec.devices == {"tuned": "cpu"}
    assert spec.dtype == "bfloat16" and spec.models == {"tuned": "finetuned"}


@pytest.mark.parametrize("kwargs, message", [
    ({"source": "rot"}, "field source: source 'rot', which is not declared in `models` (did you mean 'root'?)"),
    ({"gate": {"probe": {"tokns": 3}}}, "field gate.probe.tokns: unknown field 'tokns'; did you mean 'tokens'?"),
    ({"dtype": "float8"}, "field dtype: "),
    ({"devices": {"gpu": "cuda:0"}}, "field devices: devices names model 'gpu'"),
    ({"mapping": {"tokens": 10}}, "field mapping.tokens: "),
])
def test_bad_settings_are_refused_at_construction(kwargs, message):
    with pytest.raises(PipelineValidationError) as err:
        Pipeline("p", **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("call, message", [
    (lambda p: p.agent("KeyFacts"), "agent 'KeyFacts', field builtin: unknown built-in 'KeyFacts' (did you mean 'key_facts'?)"),
    (lambda p: p.agent("summarise"), "unknown built-in 'summarise' (did you mean 'summarizer'?)"),
    (lambda p: p.agent("_private"), "unknown built-in '_private'"),
    (lambda p: p.agent("summarizer", max_wordz=80),
     "agent 'summarizer', field args.max_wordz: unknown argument 'max_wordz' of built-in 'summarizer' (did you mean 'max_words'?)"),
    (lambda p: p.agent("summarizer", max_words="many"), "field args.max_words: Input should be a valid integer"),
    (lambda p: p.agent("summarizer", max_new_tokens=-5), "field args.max_new_tokens: max_new_tokens must be a whole number from 1 to 32768"),
    (lambda p: p.agent("summarizer", max_new_tokens=0), "from 1 to 32768"),
    (lambda p: p.agent("summarizer", max_new_tokens=1e8), "from 1 to 32768 (the most tokens one agent may generate); got 100000000"),
    (lambda p: p.agent("question_answerer"), "agent 'question_answerer', field args.question: built-in 'question_answerer' needs the argument 'question'"),
    (lambda p: p.agent("critic", name="c"), "agent 'c', field args.target_agent: built-in 'critic' needs the argument 'target_agent'"),
    (lambda p: p.agent({"task": "Check {summary"}, name="c"), "agent 'c', field spec.task: task template is not valid str.format syntax"),
    (lambda p: p.agent({"task": "Check {summary.x}"}, name="c"), "agent 'c', field spec.task: task template placeholder {summary.x} is not supported"),
    (lambda p: p.agent({"task": "t", "generation": {"max_new_tokens": 1e8}}, name="c"), "agent 'c', field spec.generation.max_new_tokens"),
    (lambda p: p.agent({"task": "t"}, name="c", max_words=3), "agent 'c', field args: keyword arguments (max_words) are a built-in agent's"),
    (lambda p: p.agent(AgentSpec(name="c", task="t"), max_words=3), "agent 'c', field args"),
    (lambda p: p.agent(42, name="c"), "agent 'c', field spec: expected a built-in agent's name, an agents.AgentSpec"),
    (lambda p: p.agent("summarizer", model="tund"), "agent 'summarizer', field model: model alias 'tund' is not one of this pipeline's models"),
    (lambda p: p.agent("summarizer", timeout_s=0), "agent 'summarizer', field timeout_s: "),
    (lambda p: p.agent("summarizer", name="bad name"), "field name: String should match pattern"),
    (lambda p: p.agent("summarizer").agent("summarizer", model="finetuned"), "agent 'summarizer', field name: the pipeline already has an agent named 'summarizer'"),
])
def test_agent_mistakes_raise_at_once_naming_agent_and_field(call, message):
    p = Pipeline("p")
    with pytest.raises(PipelineError) as err:
        call(p)
    assert message in str(err.value), str(err.value)
    assert isinstance(err.value, PipelineValidationError) and err.value.problems


def test_graph_mistakes_raise_when_the_spec_is_built():
    with pytest.raises(PipelineValidationError, match="field agents: a pipeline needs at least one agent; add one with Pipeline.agent"):
        Pipeline("p").to_spec()
    p = Pipeline("p").agent("critic", target_agent="summary")  # added in any order: checked at build time
    with pytest.raises(UnknownAgentError, match="agent 'summary_critic', field args: reads 'summary', which is not an agent"):
        p.graph()
    assert p.agent("summarizer", name="summary").spec.upstreams()["summary_critic"] == ["summary"]
    p = Pipeline("p").agent("summarizer", after="report").agent("report_writer", upstream=["summarizer"])
    with pytest.raises(CycleError, match="cycle"):
        p.to_spec()
    with pytest.raises(UnknownAgentError, match=r"field upstream: reads 'sumary', .*did you mean 'summarizer'"):
        Pipeline("p").agent("summarizer").agent("key_facts", after="sumary").to_spec()


# -- running (a stand-in Orchestra) ---------------------------------------------------------------------------

def test_run_sync_reuses_one_orchestra_until_the_pipeline_changes(fake_orchestra, tmp_path):
    family = _family(tmp_path)
    p = Pipeline("p", family=family).agent("summarizer")
    events: list[str] = []
    first = p.run_sync("doc one", on_event=events.append)
    (tmp_path / "doc.txt").write_text("doc two")
    second = p.run_sync(tmp_path / "doc.txt")  # a Path is a file to read
    assert (first.document, second.document) == ("doc one", "doc two")
    assert events == ["run_started", "run_finished"]
    assert len(fake_orchestra.made) == 1 and first.orchestra is second.orchestra
    orch = fake_orchestra.made[0]
    assert orch.spec is p.spec and orch.family is family and orch.runs == ["doc one", "doc two"]
    assert p.last_report is second

    p.agent("key_facts", model="finetuned")  # a changed pipeline gets a new Orchestra, with the new spec
    third = p.run_sync("doc three")
    assert len(fake_orchestra.made) == 2 and third.orchestra.spec.upstreams() == {"summarizer": [], "key_facts": []}


async def test_run_and_stream_in_async_code_and_run_sync_refuses(fake_orchestra, tmp_path):
    p = Pipeline("p", family=_family(tmp_path)).agent("summarizer")
    seen: list[str] = []

    async def on_event(event):
        seen.append(event)

    report = await p.run("doc", on_event=on_event)
    assert report.document == "doc" and seen == ["run_started", "run_finished"]
    assert [event async for event in p.stream("doc 2")] == ["run_started", "run_finished"]
    assert p.last_report.document == "doc 2" and len(fake_orchestra.made) == 1
    with pytest.raises(EventLoopRunningError, match=r"inside a running asyncio event loop.*await pipeline.run\(document\)"):
        p.run_sync("doc")
    assert len(fake_orchestra.made[0].runs) == 2  # nothing ran


def test_run_sync_from_a_thread_without_a_loop(fake_orchestra, tmp_path):
    """The check looks at the calling thread: plain sync code in a worker thread of an async app may use it."""
    p = Pipeline("p", family=_family(tmp_path)).agent("summarizer")

    async def main():
        return await asyncio.to_thread(p.run_sync, "from a thread")

    assert asyncio.run(main()).document == "from a thread"


def test_family_is_loaded_lazily_and_missing_family_says_how_to_build(fake_orchestra, tmp_path, monkeypatch):
    monkeypatch.delenv("ORCHESTRA_HOME", raising=False)
    p = Pipeline("p", home=tmp_path / "empty").agent("summarizer")
    assert p.spec.models == {"root": "root"}  # building and validating needed no family
    with pytest.raises(FamilyError, match="orchestra family build"):
        p.run_sync("doc")
    folder = tmp_path / "local"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    local = Pipeline("p", "mine", home=tmp_path / "empty", models={"mine": folder}).agent("summarizer", model="mine")
    local.run_sync("doc")
    assert fake_orchestra.made[-1].family is None  # only local folders: no family needed


# -- on the bundled family ---------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_python_pipeline_runs_like_its_yaml_twin(real_family, tmp_path):
    """Three agents on three members, written in Python only, give the same outputs and cache paths as the YAML
    file: one exact prefill on the root, mapped (or gate-refused, or unmapped and re-prefilled) caches on the others.

    The maps are the family home's (the finetuned one is ensured by `real_family`; a missing one is refused and
    re-prefilled with its reason, the same in both twins): calibrating two pairs here cost more than the runs."""
    from orchestra.family.corpus import data_text

    document = data_text("gpl-3.txt")[:1600]
    from pathlib import Path

    maps = str(Path(real_family.home) / "mappings")
    python = three(maps, family=real_family)
    report = python.run_sync(document)

    path = tmp_path / "three.yaml"
    path.write_text(YAML.replace("MAPS", maps))
    from_yaml = Pipeline.from_file(path, family=real_family)
    assert from_yaml.spec == python.spec
    twin = from_yaml.run_sync(document)

    names = ["summarizer", "key_facts", "summarizer_critic"]
    assert [a.name for a in report.agents] == names == [a.name for a in twin.agents]
    for name in names:
        ours, theirs = report.agent(name), twin.agent(name)
        assert (ours.status, ours.output, ours.cache_path) == (theirs.status, theirs.output, theirs.cache_path), name
    assert report.agent("summarizer").status == "succeeded" and report.agent("summarizer").output.strip()
    assert report.agent("summarizer").cache_path == "exact"
    for name in ("key_facts", "summarizer_critic"):
        agent = report.agent(name)
        assert agent.cache_path in {"mapped", "reprefilled"}, agent
        assert (agent.cache_path == "reprefilled") == (agent.fallback_reason is not None)
    assert report.agent("summarizer_critic").status == "succeeded"
    assert [c.model for c in report.caches if c.path == "exact"] == ["root"]  # the document was prefilled once
