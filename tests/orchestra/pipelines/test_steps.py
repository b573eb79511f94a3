"""Python steps and routing: functions in the DAG beside the agents, and nodes that run only when a condition holds."""

from __future__ import annotations

import json

import pytest

from orchestra import Pipeline
from orchestra.errors import PipelineValidationError
from orchestra.family.corpus import data_text
from orchestra.pipelines.spec import PipelineSpec
from orchestra.pipelines.steps import Condition
from tests.cli_run import run_pipeline_text

DOC = data_text("gpl-3.txt")[:250]


def count_words(document: str) -> dict[str, int]:
    """A step from a pipeline file: module:function."""
    return {"words": len(document.split())}


def triage(document: str) -> str:
    return "licence" if "license" in document.lower() else "other"


def _pipeline(fam, mapstore) -> Pipeline:
    return Pipeline("routed", source="base", models={"base": str(fam.parent), "child": str(fam.child)},
                    mapping={"directory": str(mapstore.directory), "on_missing": "calibrate"}, default_device="cpu")


def test_steps_feed_agents_and_conditions_route_the_rest(fam, mapstore):
    seen: dict[str, object] = {}

    async def shout(summary: str, inputs: dict[str, str]) -> str:  # async, reads an agent by name
        seen["summary"], seen["inputs"] = summary, inputs
        return summary.upper()

    def boom() -> str:
        raise RuntimeError("the lookup service is down")

    pipeline = (_pipeline(fam, mapstore)
                .with_input("focus", default="copying")
                .step(triage)
                .step(count_words, name="stats")
                .agent({"name": "summary", "task": "Summarise ({focus}).", "generation": {"max_new_tokens": 4}},
                       model="base", when={"agent": "triage", "equals": "licence"})
                .agent({"name": "other", "task": "Describe it.", "generation": {"max_new_tokens": 4}},
                       model="child", when={"agent": "triage", "equals": "other"})
                .step(shout, after="summary")
                .agent({"name": "after_other", "task": "Expand {other}", "generation": {"max_new_tokens": 4}},
                       model="base")
                .agent({"name": "uses_stats", "task": "The counts are {stats}. Comment.",
                        "generation": {"max_new_tokens": 4}}, model="child",
                       when=lambda outputs: json.loads(outputs["stats"])["words"] > 10)
                .step(boom)
                .step(lambda boom: boom, name="after_boom", after="boom"))
    report = pipeline.run_sync(DOC)
    status = {a.name: a.status for a in report.agents}
    assert status == {"summary": "succeeded", "other": "skipped", "after_other": "skipped", "uses_stats": "succeeded",
                      "triage": "succeeded", "stats": "succeeded", "shout": "succeeded", "boom": "failed",
                      "after_boom": "skipped"}
    assert report.agent("triage").output == "licence" and report.agent("triage").model == "step"
    assert json.loads(report.agent("stats").output) == {"words": len(DOC.split())}
    assert report.agent("other").skip_reason == "its condition is false: triage's output is 'other'"
    assert "upstream other did not succeed" in report.agent("after_other").skip_reason  # depends only on it
    assert seen["summary"] == report.agent("summary").output and seen["inputs"] == {"focus": "copying"}
    assert report.agent("shout").output == report.agent("summary").output.upper()
    assert report.agent("boom").error_type == "RuntimeError" and "down" in report.agent("boom").error
    pipeline.close()


def test_a_step_parameter_it_cannot_be_given_is_refused_when_added(fam, mapstore):
    def needs(nothing_like_this: str) -> str:
        return nothing_like_this

    with pytest.raises(PipelineValidationError, match="parameter 'nothing_like_this'.*name it document, inputs"):
        _pipeline(fam, mapstore).step(needs)


def test_a_pipeline_file_declares_steps_and_conditions(fam, mapstore, tmp_path):
    yaml = (f"models: {{base: '{fam.parent}'}}\nsource: base\ndefault_device: cpu\n"
            f"mapping: {{directory: '{mapstore.directory}'}}\n"
            "steps:\n  - {name: stats, call: 'tests.orchestra.pipelines.test_steps:count_words'}\n"
            "  - {name: kind, call: 'tests.orchestra.pipelines.test_steps:triage'}\n"
            "agents:\n  - {name: a, model: base, when: {agent: kind, in: [licence, contract]}, "
            "spec: {task: 'Answer: who may copy it? ({stats})', generation: {max_new_tokens: 3}}}\n"
            "  - {name: b, model: base, when: {agent: kind, contains: poem}, "
            "spec: {task: 'Say hi.', generation: {max_new_tokens: 3}}}\n")
    code, _, out = run_pipeline_text(tmp_path, yaml, DOC, "--report", str(tmp_path / "r.json"))
    assert code == 3 and "b skipped (its condition is false: kind's output contains 'poem')" in out, out
    report = json.loads((tmp_path / "r.json").read_text())
    assert {a["name"]: a["status"] for a in report["agents"]} == {"a": "succeeded", "b": "skipped",
                                                                   "stats": "succeeded", "kind": "succeeded"}
    spec = PipelineSpec.model_validate({
        "models": {"base": "base"}, "steps": [{"name": "s", "call": "tests.orchestra.pipelines.test_steps:triage"}],
        "agents": [{"name": "a", "model": "base", "spec": {"task": "x"}, "when": {"agent": "s", "equals": "y"}}]})
    assert spec.upstreams() == {"a": ["s"], "s": []}  # the tested node is waited for


def test_bad_steps_and_conditions_say_what_to_fix():
    base = {"models": {"base": "base"}, "agents": [{"name": "a", "model": "base", "spec": {"task": "x"}}]}
    with pytest.raises(PipelineValidationError, match="not 'module:function'"):
        PipelineSpec.model_validate({**base, "steps": [{"name": "s", "call": "no colon here"}]})
    with pytest.raises(PipelineValidationError, match="shares its name"):
        PipelineSpec.model_validate({**base, "steps": [{"name": "a", "call": "tests.orchestra.pipelines.test_steps:count_words"}]})
    with pytest.raises(PipelineValidationError, match="exactly one of equals"):
        PipelineSpec.model_validate({**base, "steps": [{"name": "s", "call": "tests.orchestra.pipelines.test_steps:count_words",
                                                        "when": {"agent": "a", "equals": "x", "contains": "y"}}]})
    with pytest.raises(PipelineValidationError, match="cannot import 'nosuch.module:fn'"):  # when it loads
        PipelineSpec.model_validate({**base, "steps": [{"name": "s", "call": "nosuch.module:fn"}]})
    assert Condition.model_validate({"agent": "t", "in": ["Legal.", "tax"]}).holds({"t": " legal "})


def test_a_revise_loop_is_unrolled_and_stops_at_the_first_approval(fam, mapstore):
    def build(approve: str) -> Pipeline:
        return (_pipeline(fam, mapstore)
                .revise("brief", write="Write one sentence about the document.", review="Check the sentence.",
                        model="base", critic_model="child", rounds=2, approve=approve, max_new_tokens=6)
                .agent({"name": "use", "task": "Shorten: {brief}", "generation": {"max_new_tokens": 3}}, model="base"))

    unapproved = build("NEVER-SAID-BY-A-TINY-MODEL")
    assert unapproved.spec.upstreams()["brief_draft_2"] == ["brief_draft_1", "brief_review_1"]
    report = unapproved.run_sync(DOC[:60])
    status = {a.name: a.status for a in report.agents}
    assert [status[n] for n in ("brief_draft_1", "brief_review_1", "brief_draft_2", "brief_review_2", "brief")] == \
        ["succeeded"] * 5
    assert report.agent("brief").output == report.agent("brief_draft_2").output  # the last draft that ran
    unapproved.close()
    said = report.agent("brief_review_1").output.split()[0]  # greedy: the same review again, so this approves it
    approved = build(said).run_sync(DOC[:60])
    status = {a.name: a.status for a in approved.agents}
    assert status["brief_draft_2"] == status["brief_review_2"] == "skipped"
    assert "does not contain" in approved.agent("brief_draft_2").skip_reason
    assert approved.agent("brief").output == approved.agent("brief_draft_1").output
    assert status["use"] == "succeeded"
