from __future__ import annotations

from pathlib import Path

import pytest

from orchestra.errors import PipelineFileError
from orchestra.pipeline import PipelineSpec, load_pipeline

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "long_document_analysis" / "pipeline.yaml"

GOOD = """
models: {root: root, tuned: finetuned}
agents:
  - {name: a, model: root, builtin: summarizer}
  - {name: b, model: tuned, builtin: critic, args: {target_agent: a}, upstream: [a]}
  - {name: c, model: tuned, builtin: summarizer}
"""


def _write(tmp_path, text, name="p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_example_pipeline_validates_and_builds_specs():
    spec = load_pipeline(EXAMPLE)
    assert len(spec.agents) >= 4 and len(set(spec.models.values())) >= 3
    for agent in spec.agents:
        assert agent.agent_spec().name == agent.name


def test_source_defaults_to_most_used_model(tmp_path):
    assert load_pipeline(_write(tmp_path, GOOD)).source_alias == "tuned"


def test_typo_names_file_field_and_fix(tmp_path):
    path = _write(tmp_path, GOOD.replace("upstream: [a]", "upstrem: [a]"))
    with pytest.raises(PipelineFileError) as err:
        load_pipeline(path)
    msg = str(err.value)
    assert str(path) in msg and "agents.1.upstrem" in msg and "did you mean 'upstream'" in msg


def test_unknown_model_suggests_the_close_one(tmp_path):
    with pytest.raises(PipelineFileError, match="'tuned' .*did you mean|did you mean 'tuned'"):
        load_pipeline(_write(tmp_path, GOOD.replace("model: tuned, builtin: summarizer", "model: tund, builtin: summarizer")))


def test_missing_required_field_and_bad_yaml(tmp_path):
    with pytest.raises(PipelineFileError, match="models: required field is missing"):
        load_pipeline(_write(tmp_path, "agents: [{name: a, model: m, builtin: summarizer}]"))
    with pytest.raises(PipelineFileError, match="not valid YAML"):
        load_pipeline(_write(tmp_path, "models: {a: [unclosed"))
    with pytest.raises(PipelineFileError, match="not valid JSON"):
        load_pipeline(_write(tmp_path, "{", name="p.json"))
    with pytest.raises(PipelineFileError, match="does not exist"):
        load_pipeline(tmp_path / "nope.yaml")


def test_agent_needs_exactly_one_definition_and_unique_names():
    with pytest.raises(ValueError, match="exactly one of `builtin` or `spec`"):
        PipelineSpec.model_validate({"models": {"m": "x"}, "agents": [{"name": "a", "model": "m"}]})
    with pytest.raises(ValueError, match="two agents are named 'a'"):
        PipelineSpec.model_validate({"models": {"m": "x"}, "agents": [
            {"name": "a", "model": "m", "builtin": "summarizer"}, {"name": "a", "model": "m", "builtin": "summarizer"}]})


def test_unknown_builtin_lists_known(tmp_path):
    spec = load_pipeline(_write(tmp_path, GOOD.replace("builtin: summarizer}", "builtin: summariser}", 1)))
    with pytest.raises(PipelineFileError, match="unknown builtin 'summariser'; known: .*summarizer"):
        spec.agents[0].agent_spec()


def test_graph_command_prints_mermaid_without_loading_models():
    from typer.testing import CliRunner

    from orchestra.cli import app

    result = CliRunner().invoke(app, ["graph", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("flowchart TD") and "a_summary --> a_report" in result.output


def test_cycle_in_file_is_a_clean_cli_error(tmp_path):
    from typer.testing import CliRunner

    from orchestra.cli import app

    path = _write(tmp_path, GOOD.replace("upstream: [a]}", "upstream: [a]}\n  - {name: d, model: root, builtin: summarizer, upstream: [e]}\n  - {name: e, model: root, builtin: summarizer, upstream: [d]}"))
    result = CliRunner().invoke(app, ["graph", str(path)])
    assert result.exit_code == 2 and "cycle" in result.output and "Traceback" not in result.output
