"""Trees to measure side by side: the working tree, or a git revision checked out into a temporary worktree.

Shared by the benchmarks that compare revisions in one run (`install_footprint.py`, `startup.py`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "run", "tree", "remove_tree"]


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run `cmd`, raising on failure, with its output captured as text."""
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kwargs)  # type: ignore[call-overload]


def tree(rev: str, scratch: Path) -> Path:
    """The repository at `rev` (``WORKTREE``: the working tree itself, uncommitted changes included)."""
    if rev == "WORKTREE":
        return ROOT
    where = scratch / f"tree-{rev}"
    run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev])
    return where


def remove_tree(where: Path) -> None:
    """Undo `tree` for a revision (the working tree is left alone)."""
    if where != ROOT:
        run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)])
