"""`orchestra run` on a pipeline written in the test: what a user's mistake must come back as."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from orchestra.cli import app

__all__ = ["run_pipeline_text"]


def run_pipeline_text(tmp_path: Path, pipeline: str, document: str, *args: str) -> tuple[int, list[str], str]:
    """Run `pipeline` (YAML text) over `document` with a private home and `args` (e.g. ``--input``): (exit code,
    non-blank lines, output)."""
    path = tmp_path / "p.yaml"
    path.write_text(pipeline)
    doc = tmp_path / "doc.txt"
    doc.write_text(document)
    result = CliRunner().invoke(app, ["run", str(path), "--document", str(doc), "--home", str(tmp_path / "nohome"),
                                      *args])
    return result.exit_code, [line for line in result.output.splitlines() if line.strip()], result.output
