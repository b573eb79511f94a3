"""Pipeline files and PipelineSpec: every mistake is a typed PipelineError naming the file, the agent and the
field, found when the spec is built (no model loads), and `orchestra graph` refuses exactly what `run` does."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agents import AgentSpec
from orchestra.cli import app
from orchestra.errors import (
    CycleError,
    PipelineError,
    PipelineFileError,
    PipelineValidationError,
    UnknownAgentError,
)
from orchestra.pipelines.spec import AgentNode, PipelineSpec, load_pipeline

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "long_document_analysis" / "pipeline.yaml"

GOOD = """
models: {root: root, tuned: finetuned}
agents:
  - {name: a, model: root, builtin: summarizer}
  - {name: b, model: tuned, builtin: critic, args: {target_agent: a}}
  - {name: c, model: tuned, builtin: summarizer}
"""

runner = CliRunner()


def _write(tmp_path, text, name="p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _file_error(tmp_path, text) -> PipelineFileError:
    path = _write(tmp_path, text)
    with pytest.raises(PipelineFileError) as err:
        load_pipeline(path)
    assert str(err.value).startswith(f"{path}: ") and err.value.path == path
    return err.value


def test_example_pipeline_validates_and_builds_specs():
    spec = load_pipeline(EXAMPLE)
    assert len(spec.agents) >= 4 and len(set(spec.models.values())) >= 3
    for agent in spec.agents:
        assert agent.agent_spec().name == agent.name
        assert set(agent.agent_spec().required_inputs()) <= set(agent.upstream)


def test_source_defaults_to_most_used_model(tmp_path):
    assert load_pipeline(_write(tmp_path, GOOD)).source_alias == "tuned"


def test_upstream_defaults_to_what_the_template_reads(tmp_path):
    spec = load_pipeline(_write(tmp_path, GOOD))
    assert spec.upstreams() == {"a": [], "b": ["a"], "c": []}  # the critic reads {a}: no `upstream` needed
    extra = load_pipeline(_write(tmp_path, GOOD.replace("args: {target_agent: a}}", "args: {target_agent: a}, upstream: [c]}")))
    assert extra.agent("b").upstream == ["a", "c"]  # an explicit upstream adds to the template's reads
    report = AgentNode(model="root", builtin="report_writer", args={"upstream": ["a", "b", "a"]})
    assert report.name == "report" and report.upstream == ["a", "b"]


def test_typed_agent_spec_and_default_names():
    review = AgentSpec(name="review", task="Check {summary} against the document.")
    spec = PipelineSpec(models={"root": "root"}, agents=[
        AgentNode(model="root", builtin="summarizer", args={"max_new_tokens": 24}),
        AgentNode(name="summary", model="root", builtin="summarizer"),
        AgentNode(model="root", spec=review),
        AgentNode(name="renamed", model="root", spec=review),
        AgentNode(model="root", builtin="critic", args={"target_agent": "summary"}),
    ])
    assert [a.name for a in spec.agents] == ["summarizer", "summary", "review", "renamed", "summary_critic"]
    assert spec.agent("review").agent_spec() is review and spec.agent("review").upstream == ["summary"]
    assert spec.agent("renamed").agent_spec().name == "renamed"  # the node's name wins over the spec's
    assert spec.agent("summarizer").agent_spec().generation.max_new_tokens == 24
    # a mapping is validated into an AgentSpec when the node is built
    node = AgentNode(name="check", model="root", spec={"task": "Is {summary} right?", "generation": {"max_new_tokens": 8}})
    assert isinstance(node.agent_spec(), AgentSpec) and node.upstream == ["summary"]
    # a built spec survives a round trip through its dump (what a YAML file would hold)
    again = PipelineSpec.model_validate(spec.model_dump(mode="json"))
    assert again.upstreams() == spec.upstreams() and again.agent("review").agent_spec() == review


def test_builtins_come_only_from_the_registry(tmp_path):
    for name in ("KeyFacts", "Field", "_private", "GenerationSettings"):
        err = _file_error(tmp_path, GOOD.replace("builtin: summarizer}", f"builtin: {name}}}", 1))
        assert f"agent 'a', field builtin (agents.0.builtin): unknown built-in {name!r}" in str(err)
        assert "built-ins: summarizer, key_facts, question_answerer, critic, report_writer" in str(err)
    err = _file_error(tmp_path, GOOD.replace("builtin: summarizer}", "builtin: KeyFacts}", 1))
    assert "did you mean 'key_facts'?" in str(err)
    err = _file_error(tmp_path, GOOD.replace("builtin: summarizer}", "builtin: summariser}", 1))
    assert "did you mean 'summarizer'?" in str(err)


@pytest.mark.parametrize("args, field, expected", [
    ("{max_wordz: 80}", "args.max_wordz",
     "unknown argument 'max_wordz' of built-in 'summarizer' (did you mean 'max_words'?); it takes: name, max_words, max_new_tokens"),
    ("{max_words: eighty}", "args.max_words", "valid integer"),
    ("{max_new_tokens: -5}", "args.max_new_tokens", "from 1 to 32768"),
    ("{max_new_tokens: 0}", "args.max_new_tokens", "from 1 to 32768"),
    ("{max_new_tokens: 100000000}", "args.max_new_tokens", "from 1 to 32768 (the most tokens one agent may generate); got 100000000"),
])
def test_bad_builtin_arguments_name_agent_and_field(tmp_path, args, field, expected):
    err = _file_error(tmp_path, GOOD.replace("builtin: summarizer}", f"builtin: summarizer, args: {args}}}", 1))
    assert f"agent 'a', field {field} (agents.0.{field}): " in str(err) and expected in str(err)
    assert "\n" not in str(err) and len(err.problems) == 1
    problem = err.problems[0]
    assert (problem.agent, problem.field, problem.location) == ("a", field, f"agents.0.{field}")


def test_missing_required_argument_and_wrong_kinds(tmp_path):
    err = _file_error(tmp_path, GOOD.replace("builtin: summarizer}", "builtin: question_answerer}", 1))
    assert "agent 'a', field args.question (agents.0.args.question): built-in 'question_answerer' needs the argument 'question'" in str(err)
    err = _file_error(tmp_path, GOOD.replace("args: {target_agent: a}", "args: {target_agent: not a name}"))
    assert "agent 'b', field args.target_agent" in str(err) and "should match pattern" in str(err)
    err = _file_error(tmp_path, GOOD.replace("builtin: summarizer}", "builtin: report_writer, args: {upstream: c}}", 1))
    assert "field args.upstream" in str(err)
    err = _file_error(tmp_path, GOOD.replace("builtin: summarizer}", "builtin: summarizer, args: {max_words: 3, max_wordz: 4, max_new_tokens: 0}}", 1))
    assert len(err.problems) == 2 and "2 problems" in str(err)
    assert {p.field for p in err.problems} == {"args.max_wordz", "args.max_new_tokens"}


@pytest.mark.parametrize("task, expected", [
    ("Check {summary", "not valid str.format syntax"),
    ("Check {summary.text}", "placeholder {summary.text} is not supported"),
    ("Check {0}", "placeholder {0} is not supported"),
    ("Check {summary!r}", "placeholder {summary!r} is not supported"),
])
def test_bad_inline_template_names_agent_and_spec_task(tmp_path, task, expected):
    text = GOOD + f"  - {{name: d, model: root, spec: {{task: '{task}'}}}}\n"
    err = _file_error(tmp_path, text)
    assert "agent 'd', field spec.task (agents.3.spec.task): " in str(err) and expected in str(err)


def test_inline_spec_fields_are_checked_with_did_you_mean(tmp_path):
    err = _file_error(tmp_path, GOOD + "  - {name: d, model: root, spec: {tsk: hi, generation: {max_new_tokens: 0}}}\n")
    assert {p.field for p in err.problems} == {"spec.task", "spec.tsk", "spec.generation.max_new_tokens"}
    assert "unknown field 'tsk'; did you mean 'task'?" in str(err)
    err = _file_error(tmp_path, GOOD + "  - {name: d, model: root, spec: {task: hi}, args: {max_words: 3}}\n")
    assert "agent 'd', field args" in str(err) and "put its settings in the spec" in str(err)


def test_typo_names_file_field_and_fix(tmp_path):
    err = _file_error(tmp_path, GOOD.replace("args: {target_agent: a}}", "args: {target_agent: a}, upstrem: [a]}"))
    assert "agent 'b', field upstrem (agents.1.upstrem)" in str(err) and "did you mean 'upstream'" in str(err)
    err = _file_error(tmp_path, GOOD + "gate: {probe: {tokns: 3}}\n")
    assert "field gate.probe.tokns: unknown field 'tokns'; did you mean 'tokens'?" in str(err)


def test_unknown_model_suggests_the_close_one(tmp_path):
    err = _file_error(tmp_path, GOOD.replace("model: tuned, builtin: summarizer", "model: tund, builtin: summarizer"))
    assert "agent 'c', field model: uses model 'tund'" in str(err) and "did you mean 'tuned'" in str(err)
    err = _file_error(tmp_path, GOOD + "source: rot\n")
    assert "field source: source 'rot'" in str(err) and "did you mean 'root'" in str(err)


def test_unknown_upstream_and_cycles_name_file_agent_and_field(tmp_path):
    path = _write(tmp_path, GOOD.replace("args: {target_agent: a}}", "args: {target_agent: a}, upstream: [cc]}"))
    with pytest.raises(UnknownAgentError) as err:
        load_pipeline(path)
    assert str(err.value).startswith(f"{path}: agent 'b', field upstream: reads 'cc'") and "did you mean 'c'" in str(err.value)
    path = _write(tmp_path, GOOD.replace("target_agent: a}", "target_agent: summary}"))
    with pytest.raises(UnknownAgentError, match="agent 'b', field args: reads 'summary'"):
        load_pipeline(path)
    path = _write(tmp_path, GOOD + "  - {name: d, model: root, spec: {task: '{e}'}}\n  - {name: e, model: root, spec: {task: '{d}'}}\n")
    with pytest.raises(CycleError, match=r"p.yaml: the agents form a cycle: (d -> e -> d|e -> d -> e)"):
        load_pipeline(path)
    with pytest.raises(CycleError, match="agent 'd', field spec.task: the agent reads its own output"):
        load_pipeline(_write(tmp_path, GOOD + "  - {name: d, model: root, spec: {task: 'again {d}'}}\n"))


def test_missing_required_field_and_bad_yaml(tmp_path):
    with pytest.raises(PipelineFileError, match="field models: required field is missing"):
        load_pipeline(_write(tmp_path, "agents: [{name: a, model: m, builtin: summarizer}]"))
    with pytest.raises(PipelineFileError, match="not valid YAML"):
        load_pipeline(_write(tmp_path, "models: {a: [unclosed"))
    with pytest.raises(PipelineFileError, match="not valid JSON"):
        load_pipeline(_write(tmp_path, "{", name="p.json"))
    with pytest.raises(PipelineFileError, match="does not exist"):
        load_pipeline(tmp_path / "nope.yaml")
    with pytest.raises(PipelineFileError, match="a pipeline needs at least one agent"):
        load_pipeline(_write(tmp_path, "models: {root: root}\nagents: []\n"))


def test_python_mistakes_are_pipeline_errors_too():
    with pytest.raises(PipelineValidationError, match="exactly one of `builtin` or `spec`"):
        PipelineSpec.model_validate({"models": {"m": "x"}, "agents": [{"name": "a", "model": "m"}]})
    with pytest.raises(ValueError, match="two agents are named 'a'"):  # also a ValueError, like pydantic's
        PipelineSpec.model_validate({"models": {"m": "x"}, "agents": [
            {"name": "a", "model": "m", "builtin": "summarizer"}, {"name": "a", "model": "m", "builtin": "summarizer"}]})
    with pytest.raises(PipelineValidationError) as err:
        AgentNode(name="s", model="root", builtin="summarizer", args={"max_wordz": 3})
    assert str(err.value).startswith("agent 's', field args.max_wordz: unknown argument 'max_wordz'")
    with pytest.raises(PipelineValidationError, match="field spec: must be an agents.AgentSpec or a mapping"):
        AgentNode(name="s", model="root", spec="Summarize")
    with pytest.raises(PipelineError, match=r"agent 'x', field spec.generation.max_new_tokens \(agents.0.spec.generation.max_new_tokens\): .*got 100000000"):
        PipelineSpec(models={"root": "root"}, agents=[
            {"name": "x", "model": "root", "spec": {"task": "t", "generation": {"max_new_tokens": 1e8}}}])


def test_graph_command_prints_mermaid_without_loading_models():
    result = runner.invoke(app, ["graph", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("flowchart TD") and "a_summary --> a_report" in result.output


@pytest.mark.parametrize("change, expected", [
    (("builtin: summarizer}", "builtin: KeyFacts}"), "unknown built-in 'KeyFacts' (did you mean 'key_facts'?)"),
    (("builtin: summarizer}", "builtin: summarizer, args: {max_wordz: 80}}"), "field args.max_wordz"),
    (("builtin: summarizer}", "builtin: summarizer, args: {max_new_tokens: -5}}"), "from 1 to 32768"),
    (("builtin: summarizer}", "builtin: question_answerer}"), "needs the argument 'question'"),
    (("builtin: summarizer}", "spec: {task: 'Check {x'}}"), "field spec.task"),
    (("target_agent: a}", "target_agent: summary}"), "UnknownAgentError: "),
])
def test_graph_validates_as_deeply_as_run(tmp_path, change, expected):
    """A pipeline `run` would refuse before loading a model is refused by `graph`: exit 2, one line, no traceback."""
    path = _write(tmp_path, GOOD.replace(*change, 1))
    with pytest.raises(PipelineError):
        load_pipeline(path)
    for args in (["graph", str(path)], ["run", str(path), "--document", str(path)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], result.output
        assert expected in lines[0] and "Traceback" not in result.output


def test_cycle_in_file_is_a_clean_cli_error(tmp_path):
    path = _write(tmp_path, GOOD + "  - {name: d, model: root, builtin: summarizer, upstream: [e]}\n"
                                   "  - {name: e, model: root, builtin: summarizer, upstream: [d]}\n")
    result = runner.invoke(app, ["graph", str(path)])
    assert result.exit_code == 2 and "cycle" in result.output and "Traceback" not in result.output
