"""A model folder's weights digest, computed once and kept beside the folder (or under the orchestra home).

Hashing every tensor of a folder is the slow part of its fingerprint (seconds per 100M parameters);
the config and tokenizer parts are cheap and always computed fresh (`mappings.fingerprint
.fingerprint_with_weights`), so only the weights digest is kept. It is stored in
``<folder>/.orchestra-fingerprint.json`` with the name, size and mtime_ns of every ``*.safetensors``
file it was computed from, and recomputed as soon as any of them changes (or one is added or
removed). A folder that cannot be written (a read-only mount, someone else's folder) and a Hugging
Face snapshot (whose folders belong to huggingface_hub) keep it under
``<orchestra home>/fingerprints/<sha256 of the folder's path>.json`` instead. The file is written
to a temporary sibling and renamed into place, so a reader never sees half of one; an unreadable or
corrupt file is ignored and rewritten. Caching is only an optimisation: a file that cannot be
written is logged and the digest returned all the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

__all__ = ["CACHE_NAME", "CACHE_VERSION", "folder_weights_digest", "cache_paths", "weights_stamp"]

CACHE_NAME = ".orchestra-fingerprint.json"
CACHE_VERSION = 1
"""Bump when the weights digest of `mappings.fingerprint.weights_digest_dir` changes: older files are recomputed."""

# the fault-injection step of the cache write (`mappings.atomic.fault_point`), for the crash tests
WRITE_STEP = "fingerprint.cache"

log = logging.getLogger("orchestra.models.fpcache")

FileStamp = dict[str, int]


def weights_stamp(folder: Path) -> dict[str, FileStamp]:
    """Name -> size and mtime_ns of every ``*.safetensors`` file (what the weights digest is computed from)."""
    stamps: dict[str, FileStamp] = {}
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()  # follows links: a folder of links to the weights is stamped by the weights themselves
        stamps[f.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return stamps


def _is_hub_snapshot(folder: Path) -> bool:
    return folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--")


def cache_paths(folder: Path, home: Path | None = None) -> tuple[Path | None, Path]:
    """Where the folder's cache file may be: beside it (None when the folder is not ours to write) and in the home."""
    from orchestra.paths import default_home

    folder = folder.resolve()
    beside = None if _is_hub_snapshot(folder) or not os.access(folder, os.W_OK) else folder / CACHE_NAME
    key = hashlib.sha256(str(folder).encode()).hexdigest()[:32]
    return beside, (home if home is not None else default_home()) / "fingerprints" / f"{key}.json"


def _read(path: Path, stamp: dict[str, FileStamp]) -> str | None:
    """The cached digest if `path` holds one for exactly these files, else None (missing, stale or corrupt)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError):
        log.warning("ignoring the unreadable fingerprint cache %s; computing it again", path)
        return None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("files") != stamp:
        return None
    weights = data.get("weights")
    return weights if isinstance(weights, str) and len(weights) == 64 else None


def _write(paths: list[Path], payload: dict[str, object]) -> Path | None:
    """Write the cache to the first of `paths` that takes it (atomically); None if none does."""
    from mappings.atomic import write_atomic

    text = json.dumps(payload, indent=2, sort_keys=True) + "\n"
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return write_atomic(path, text, step=WRITE_STEP)
        except OSError as exc:
            log.warning("cannot keep the fingerprint cache at %s (%s)", path, exc.strerror or exc)
    return None


def folder_weights_digest(folder: str | os.PathLike[str], *, home: Path | None = None) -> str:
    """The weights digest of a model folder: read from its cache file when that is current, else computed and kept."""
    from mappings import fingerprint

    folder = Path(folder)
    stamp = weights_stamp(folder)
    beside, in_home = cache_paths(folder, home)
    candidates = [p for p in (beside, in_home) if p is not None]
    for path in candidates:
        cached = _read(path, stamp)
        if cached is not None:
            return cached
    weights = fingerprint.weights_digest_dir(folder)
    if stamp != weights_stamp(folder):  # rewritten while it was read: the digest may mix two versions
        return weights
    _write(candidates, {"version": CACHE_VERSION, "folder": str(folder.resolve()), "files": stamp, "weights": weights})
    return weights
