"""Where orchestra keeps its cache (the family home)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["HOME_ENV", "default_home", "resolve_home"]

HOME_ENV = "ORCHESTRA_HOME"


def default_home() -> Path:
    """The family home: ``$ORCHESTRA_HOME`` or ``~/.cache/orchestra``."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "orchestra"


def resolve_home(home: str | os.PathLike[str] | None, *, writable: bool = True) -> Path:
    """Return a usable home directory, creating it; raise a typed error if it cannot be used.

    ``writable=False`` is for reading an existing home: nothing is created and a read-only home is fine.
    """
    from orchestra.errors import FamilyHomeError

    path = Path(home).expanduser() if home is not None else default_home()
    if path.exists() and not path.is_dir():
        raise FamilyHomeError(
            f"family home {path} exists and is not a directory; pass --home with a directory path "
            f"or set {HOME_ENV}"
        )
    if not writable:
        return path.resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FamilyHomeError(
            f"cannot create family home {path}: {exc.strerror or exc}; pass --home with a writable "
            f"directory or set {HOME_ENV}"
        ) from exc
    if not os.access(path, os.W_OK):
        raise FamilyHomeError(f"family home {path} is not writable; pass --home with a writable directory")
    return path.resolve()
