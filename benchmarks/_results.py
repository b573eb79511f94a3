"""Writing a benchmark's results: the JSON (with the command that made it) and the Markdown table, each
written to a temporary sibling and renamed into place, so an interrupted run never leaves half a file.

Every benchmark that writes one result pair goes through it; the scripts are run as programs, so
``benchmarks/`` is on ``sys.path`` and they import it as ``_results``.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

__all__ = ["command_line", "write_results"]


def command_line(script: str, argv: list[str] | None) -> str:
    """How the run was asked for, as a reader would retype it."""
    return (f"python benchmarks/{script} " + shlex.join(argv if argv is not None else sys.argv[1:])).strip()


def write_results(out: Path, stem: str, payload: dict[str, Any], md: str) -> None:
    """``out/<stem>.json`` and ``out/<stem>.md``, each atomically; prints the table."""
    from mappings.atomic import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / f"{stem}.json", json.dumps(payload, indent=2))
    write_atomic(out / f"{stem}.md", md)
    print(md)
