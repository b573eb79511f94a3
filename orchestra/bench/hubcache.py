"""A Hugging Face hub cache laid out as huggingface_hub lays it out, for tests and benchmarks that read it offline.

``models--org--name/{blobs,refs,snapshots}``: snapshot files are relative links to ``blobs/<sha256>``,
refs name commits; the real huggingface_hub resolves ids and revisions against it with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["snapshot", "set_ref", "hub_repo"]


def snapshot(repo: Path, commit: str, folder: Path, *, link: bool = True) -> Path:
    """``repo/snapshots/<commit>`` holding `folder`'s files, each a link to ``blobs/<sha256>`` (or a copy)."""
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(folder.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        data = f.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if not (repo / "blobs" / digest).exists():
            (repo / "blobs" / digest).write_bytes(data)
        if link:  # relative, as huggingface_hub makes them
            (snap / f.name).symlink_to(Path("..", "..", "blobs", digest))
        else:
            (snap / f.name).write_bytes(data)
    return snap


def set_ref(repo: Path, name: str, commit: str) -> None:
    """``repo/refs/<name>`` names `commit` (a branch or tag, as the Hub cache records them)."""
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / name).write_text(commit)


def hub_repo(cache: Path, repo_id: str, folder: Path, *, revision: str = "main") -> Path:
    """`folder` as the one snapshot of `repo_id` in the hub cache at `cache`, `revision` pointing at it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snap = snapshot(repo, commit, folder)
    set_ref(repo, revision, commit)
    return snap
