from __future__ import annotations

import pytest
from typer.testing import CliRunner

from orchestra.cli import app

runner = CliRunner()


def _commands(group, prefix=()):
    for name, cmd in group.commands.items():
        yield (*prefix, name)
        if getattr(cmd, "commands", None):  # a group (typer may vendor its own click)
            yield from _commands(cmd, (*prefix, name))


def test_every_command_has_help():
    import typer.main

    root = typer.main.get_command(app)
    paths = list(_commands(root))
    assert {("demo",), ("family",), ("family", "build"), ("family", "show"), ("family", "train-delta"),
            ("calibrate",), ("evaluate",), ("run",), ("graph",)} <= set(paths)
    for path in paths:
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert "Usage" in result.output


def test_family_show_on_empty_home_is_a_clean_error(tmp_path):
    result = runner.invoke(app, ["family", "show", "--home", str(tmp_path)])
    assert result.exit_code == 2
    assert "orchestra family build" in result.output
    assert "Traceback" not in result.output


@pytest.mark.real_model
def test_family_show_prints_each_member(real_family):
    result = runner.invoke(app, ["family", "show", "--home", real_family.home])
    assert result.exit_code == 0, result.output
    for name in real_family.members:
        assert name[:12] in result.output
