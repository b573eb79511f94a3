"""Runtime inputs: values given per run that task templates read like upstream outputs.

The spec and input checks need no model; the runs use the tiny llama pair, one pipeline object run
twice with other questions over one document (the second reuses the document's caches).
"""

from __future__ import annotations

import anyio
import pytest

from orchestra import Pipeline
from orchestra.errors import PipelineValidationError, RunInputError, UnknownAgentError
from orchestra.family.corpus import data_text
from orchestra.pipelines.inputs import InputSpec, parse_input_args, resolve_inputs
from orchestra.pipelines.spec import PipelineSpec
from tests.cli_run import run_pipeline_text

DOC = data_text("gpl-3.txt")[:200]


def _spec(**extra) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "models": {"base": "base"},
        "agents": [{"name": "answer", "model": "base", "spec": {"task": "Answer: {question}"}},
                   {"name": "check", "model": "base", "spec": {"task": "Check {answer} against {question}"}}],
        **extra})


def test_a_template_reads_a_declared_input_which_is_not_an_upstream():
    spec = _spec(inputs=["question"])
    assert spec.inputs == {"question": InputSpec()}
    assert spec.upstreams() == {"answer": [], "check": ["answer"]}
    assert spec.input_reads("check") == ("question",)


def test_an_undeclared_template_name_says_to_declare_it():
    with pytest.raises(UnknownAgentError, match=r"reads 'question'.*declare 'question' in the pipeline's `inputs`"):
        _spec()


def test_an_input_may_not_share_an_agents_name_or_be_waited_for():
    with pytest.raises(PipelineValidationError, match="an input and an agent share this name"):
        _spec(inputs=["question", "answer"])
    with pytest.raises(PipelineValidationError, match="an input is read by the task template, not waited for"):
        PipelineSpec.model_validate({
            "models": {"base": "base"}, "inputs": ["question"],
            "agents": [{"name": "a", "model": "base", "spec": {"task": "x"}, "upstream": ["question"]}]})
    with pytest.raises(PipelineValidationError, match="an input's name"):
        _spec(inputs=["question", "bad name"])


def test_values_come_from_the_run_else_the_default_and_mistakes_name_the_fix():
    declared = {"question": InputSpec(description="what to ask"), "tone": InputSpec(default="plain")}
    assert resolve_inputs(declared, {"question": "Who?"}) == {"question": "Who?", "tone": "plain"}
    with pytest.raises(RunInputError, match=r"missing input question: give --input question=\.\.\..*what to ask"):
        resolve_inputs(declared, {})
    with pytest.raises(RunInputError, match="input 'qestion' is not declared by the pipeline; its inputs: question, tone"):
        resolve_inputs(declared, {"qestion": "x"})
    with pytest.raises(RunInputError, match="must be text"):
        resolve_inputs(declared, {"question": 3})
    assert parse_input_args(["question=a=b", "tone="]) == {"question": "a=b", "tone": ""}
    with pytest.raises(RunInputError, match="is not NAME=VALUE"):
        parse_input_args(["question"])
    with pytest.raises(RunInputError, match="given twice"):
        parse_input_args(["q=a", "q=b"])


def test_one_pipeline_answers_other_questions_over_one_document_reusing_its_cache(fam, mapstore, tmp_path):
    pipeline = (Pipeline("qa", source="base", models={"base": str(fam.parent), "child": str(fam.child)},
                         mapping={"directory": str(mapstore.directory), "on_missing": "calibrate"},
                         default_device="cpu")
                .with_input("question", description="what to ask")
                .agent({"name": "answer", "task": "Answer briefly: {question}", "generation": {"max_new_tokens": 4}},
                       model="base")
                .agent({"name": "child_answer", "task": "{question} Say why.", "generation": {"max_new_tokens": 4}},
                       model="child"))
    with pytest.raises(RunInputError, match="missing input question"):
        pipeline.run_sync(DOC)
    short = pipeline.run_sync(DOC, inputs={"question": "Who?"})
    long = pipeline.run_sync(DOC, inputs={"question": "Which freedoms does the licence say every user has, "
                                                      "and who must keep the notices intact?"})
    assert [a.status for a in short.agents + long.agents] == ["succeeded"] * 4
    assert short.inputs == {"question": "Who?"} and long.inputs["question"].startswith("Which freedoms")
    for name in ("answer", "child_answer"):  # the question is in each agent's own suffix, not the document
        assert long.agent(name).suffix_tokens > short.agent(name).suffix_tokens
    assert long.document_tokens == short.document_tokens
    # the second run computes no document prefill: every member's cache comes from the first run's
    assert all(c.store_hit for c in long.caches) and long.prefill_s_spent == 0
    pipeline.close()


def test_the_cli_takes_inputs_and_exits_2_naming_a_missing_one(fam, mapstore, tmp_path):
    yaml = (f"models: {{base: '{fam.parent}'}}\nsource: base\ndefault_device: cpu\n"
            f"mapping: {{directory: '{mapstore.directory}'}}\n"
            "inputs: {question: {description: what to ask}}\n"
            "agents:\n  - {name: answer, model: base, spec: {task: 'Answer: {question}', "
            "generation: {max_new_tokens: 3}}}\n")
    code, lines, out = run_pipeline_text(tmp_path, yaml, DOC)
    assert code == 2 and len(lines) == 1 and "missing input question: give --input question=..." in lines[0], out
    code, lines, out = run_pipeline_text(tmp_path, yaml, DOC, "--input", "quest=x")
    assert code == 2 and "input 'quest' is not declared" in out
    code, _, out = run_pipeline_text(tmp_path, yaml, DOC, "--input", "question=Who may copy it?")
    assert code == 0, out


def test_stream_passes_inputs_through(fam, mapstore):
    pipeline = (Pipeline("qa", source="base", models={"base": str(fam.parent)}, default_device="cpu",
                         mapping={"directory": str(mapstore.directory)})
                .with_input("question", default="Who?")
                .agent({"name": "answer", "task": "{question}", "generation": {"max_new_tokens": 2}}, model="base"))

    async def main() -> list[str]:
        return [e.kind async for e in pipeline.stream(DOC)]

    kinds = anyio.run(main)
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished"
    assert pipeline.last_report is not None and pipeline.last_report.inputs == {"question": "Who?"}
    pipeline.close()


def test_jsonl_prints_only_json_lines_ending_with_the_report(fam, mapstore, tmp_path):
    import json

    yaml = (f"models: {{base: '{fam.parent}'}}\nsource: base\ndefault_device: cpu\n"
            f"mapping: {{directory: '{mapstore.directory}'}}\n"
            "inputs: [question]\n"
            "agents:\n  - {name: answer, model: base, spec: {task: 'Answer: {question}', "
            "generation: {max_new_tokens: 3}}}\n")
    code, lines, out = run_pipeline_text(tmp_path, yaml, DOC, "--input", "question=Who?", "--jsonl")
    assert code == 0, out
    events = [json.loads(line) for line in lines]  # every line is one JSON object
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished" and "token" in kinds
    report = events[-1]["report"]
    assert report["inputs"] == {"question": "Who?"} and report["agents"][0]["name"] == "answer"


async def test_concurrent_runs_each_get_their_own_report_in_run_finished(fam, mapstore):
    pipeline = (Pipeline("qa", source="base", models={"base": str(fam.parent)}, default_device="cpu",
                         mapping={"directory": str(mapstore.directory)})
                .with_input("question")
                .agent({"name": "answer", "task": "{question}", "generation": {"max_new_tokens": 3}}, model="base"))
    finished: dict[str, object] = {}

    async def one(question: str) -> None:
        async for event in pipeline.stream(DOC, inputs={"question": question}):
            if event.kind == "run_finished":
                finished[question] = event.report

    async with anyio.create_task_group() as tg:
        for question in ("Who?", "What?", "Why?"):
            tg.start_soon(one, question)
    assert {q: r.inputs["question"] for q, r in finished.items()} == {q: q for q in ("Who?", "What?", "Why?")}
    pipeline.close()


def test_a_run_writes_its_prometheus_metrics_for_the_textfile_collector(fam, mapstore, tmp_path):
    yaml = (f"name: qa\nmodels: {{base: '{fam.parent}'}}\nsource: base\ndefault_device: cpu\n"
            f"mapping: {{directory: '{mapstore.directory}'}}\n"
            "agents:\n  - {name: answer, model: base, spec: {task: 'Answer.', generation: {max_new_tokens: 3}}}\n")
    target = tmp_path / "textfile" / "orchestra.prom"
    code, _, out = run_pipeline_text(tmp_path, yaml, DOC, "--metrics", str(target))
    assert code == 0, out
    text = target.read_text()
    assert 'orchestra_pipeline_runs_total{pipeline="qa",status="succeeded"} 1.0' in text
    assert 'orchestra_pipeline_cache_paths_total{model_name="base",path="exact"} 1.0' in text
    assert "orchestra_pipeline_agent_ttft_seconds_count" in text and "vllm:" not in text  # the run's series alone
