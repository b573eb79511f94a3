from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestra.cli import app
from tests.waiting import HANG_GUARD_S

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


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_version_and_exits_0(flag):
    from orchestra import __version__

    result = runner.invoke(app, [flag])
    assert result.exit_code == 0, result.output
    assert result.output == f"orchestra {__version__}\n"


def test_version_from_the_console_entry_point():
    """Through `main` (the console script's exit path) in a fresh process: one line, exit 0, even before a command."""
    import subprocess
    import sys

    from orchestra import __version__

    code = "import sys; sys.argv = ['orchestra', '--version', 'run']; from orchestra.cli import main; main()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == f"orchestra {__version__}\n" and out.stderr == ""


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


@pytest.mark.real_model
def test_family_calibrate_keeps_existing_mappings(real_family):
    """Offline calibration into the family store: an existing mapping is kept (loaded and checked), not refitted."""
    root, member = real_family.member("root"), real_family.member("finetuned")
    first = runner.invoke(app, ["family", "calibrate", "--home", real_family.home, "--member", "finetuned",
                                "--no-repair"])
    assert first.exit_code == 0, first.output
    folder = next((Path(real_family.home) / "mappings").glob(f"{root.name}__to__{member.name}__*"))
    stamp = (folder / "manifest.json").stat().st_mtime_ns
    again = runner.invoke(app, ["family", "calibrate", "--home", real_family.home, "--member", "finetuned",
                                "--no-repair"])
    assert again.exit_code == 0, again.output
    assert f"{member.name}: kept {folder.name}" in " ".join(again.output.split())
    assert (folder / "manifest.json").stat().st_mtime_ns == stamp
    bad = runner.invoke(app, ["family", "calibrate", "--home", real_family.home, "--member", "nope"])
    assert bad.exit_code == 2 and "nope" in bad.output
