"""`orchestra serve --engine`: a wrong engine, or vLLM missing, is one line and exit 2, before anything starts."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from orchestra.cli import app
from orchestra.errors import install_command


def test_an_unknown_engine_is_refused_naming_the_choices() -> None:
    result = CliRunner().invoke(app, ["serve", "--engine", "tgi"])
    assert result.exit_code == 2
    assert "--engine 'tgi': use orchestra or vllm" in result.output
    assert "Traceback" not in result.output


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_engine_without_vllm_says_what_to_install() -> None:
    result = CliRunner().invoke(app, ["serve", "--engine", "vllm"])
    assert result.exit_code == 2
    assert install_command("vllm") in result.output and "docs/vllm.md" in result.output
    assert "Traceback" not in result.output


def test_a_malformed_vllm_adapter_is_one_line_naming_the_form() -> None:
    result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--vllm-adapter", "legal"])
    assert result.exit_code == 2
    assert "--vllm-adapter 'legal': write NAME=VALUE" in result.output
    assert "Traceback" not in result.output
