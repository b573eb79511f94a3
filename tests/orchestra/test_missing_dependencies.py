"""A library the main job needs that is not installed stops the command at once, with the install command.

Never a silently different run: without the grammar library a JSON agent used to decode unconstrained
and fail after minutes (TruncatedOutputError); without the builder's libraries `orchestra demo` used to
fail minutes into converting the GGUF.
"""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from agents.errors import MissingDependencyError
from orchestra.cli import app
from orchestra.errors import install_command
from orchestra.family.corpus import data_text
from tests.tiny_family import build_tiny_family

runner = CliRunner()


@pytest.fixture
def no_xgrammar(monkeypatch):
    import agents.constrained as constrained

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # what an environment without it looks like to import
    monkeypatch.setattr(constrained, "_COMPILERS", {})
    monkeypatch.setattr(constrained, "_GRAMMARS", type(constrained._GRAMMARS)())


def _pipeline(tmp_path, tiny_root, agent: str):
    fam = build_tiny_family(tiny_root, "llama")
    path = tmp_path / "p.yaml"
    path.write_text(f"models: {{base: '{fam.parent}'}}\nsource: base\ndefault_device: cpu\nagents:\n  - {agent}\n")
    doc = tmp_path / "doc.txt"
    doc.write_text(data_text("gpl-3.txt")[:150])
    return path, doc


def test_a_json_agent_without_the_grammar_library_is_refused_before_the_run_with_the_install_command(
        no_xgrammar, tmp_path, tiny_root):
    path, doc = _pipeline(tmp_path, tiny_root, "{name: f, model: base, builtin: key_facts, args: {max_new_tokens: 8}}")
    result = runner.invoke(app, ["run", str(path), "--document", str(doc)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: MissingDependencyError:"), result.output
    assert "pip install 'xgrammar" in lines[0] and "Traceback" not in result.output


def test_a_text_only_pipeline_runs_without_the_grammar_library(no_xgrammar, tmp_path, tiny_root):
    path, doc = _pipeline(tmp_path, tiny_root,
                          "{name: s, model: base, builtin: summarizer, args: {max_words: 5, max_new_tokens: 4}}")
    result = runner.invoke(app, ["run", str(path), "--document", str(doc)])
    assert result.exit_code == 0, result.output


def test_running_a_json_agent_directly_without_the_grammar_library_raises_instead_of_decoding_unconstrained(
        no_xgrammar, tiny_root):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agents import DocumentPrompt, generate
    from agents.builtin import key_facts

    fam = build_tiny_family(tiny_root, "llama")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(fam.parent), AutoTokenizer.from_pretrained(fam.parent)
    with pytest.raises(MissingDependencyError, match="pip install 'xgrammar"):
        generate(model, tokenizer, key_facts(max_new_tokens=4),
                 prefix_ids=DocumentPrompt(data_text("gpl-3.txt")[:60]).token_ids(tokenizer))


def test_the_demo_refuses_at_once_without_the_family_builders_libraries(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "peft", None)
    monkeypatch.setenv("ORCHESTRA_HOME", str(tmp_path / "home"))
    result = runner.invoke(app, ["demo", "--home", str(tmp_path / "home")])
    assert result.exit_code == 2, result.output
    assert "MissingDependencyError" in result.output and install_command("build") in result.output
    assert not (tmp_path / "home" / "family" / "smollm2-135m-instruct").exists()  # nothing was converted


def test_the_demo_refuses_at_once_without_the_grammar_library(no_xgrammar, tmp_path):
    result = runner.invoke(app, ["demo", "--home", str(tmp_path / "home")])
    assert result.exit_code == 2 and "pip install 'xgrammar" in result.output, result.output
    assert not (tmp_path / "home").exists()
