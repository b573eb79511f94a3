"""Crash-safe writes: every artifact is written to a temporary sibling and renamed into place.

- :func:`write_atomic` writes one file (JSON, a report, a safetensors blob) next to its destination,
  flushes it, gives it the usual permissions (``mkstemp`` makes 0600 files) and renames it over the
  destination, so a reader sees the old file or the new one, never half of one. A destination that
  exists and is not a regular file (``/dev/stdout``, a pipe) is written in place.
- :func:`install_dir` puts a complete temporary folder at its destination. An existing folder is
  swapped out in one step (Linux ``renameat2(RENAME_EXCHANGE)``; elsewhere two renames, undone by
  :func:`recover_dir` if a crash falls between them) and deleted only once its successor is in place.
- :func:`temp_dir` makes the temporary sibling, named ``.<name>.tmp-<pid>-<host>-<random>``; leftovers of
  dead processes (a crash, SIGKILL) are removed with a warning the next time that destination is written
  (those of another host sharing the folder only once they are a day old).
- :func:`fault_point` is the fault-injection hook the crash tests use: ``ORCHESTRA_FAULT=STEP:ACTION``
  (comma-separated for several; ``STEP#N`` for the N-th time that step is reached) makes the process
  send itself SIGINT (``INT``) or SIGKILL (``KILL``), or fail as a full disk (``ENOSPC``), when it
  reaches that write step. Unset (always, outside tests) it does nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

__all__ = ["FAULT_ENV", "fault_point", "write_atomic", "temp_dir", "install_dir", "recover_dir", "clean_stale",
           "publish_mode"]

FAULT_ENV = "ORCHESTRA_FAULT"
log = logging.getLogger("orchestra.documents.files")

_counts: dict[str, int] = {}
_counts_lock = threading.Lock()


def fault_point(step: str) -> None:
    """The fault-injection hook: act as ``$ORCHESTRA_FAULT`` says when the write step `step` is reached."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    with _counts_lock:
        _counts[step] = seen = _counts.get(step, 0) + 1
    for item in spec.split(","):
        where, _, action = item.strip().partition(":")
        name, _, nth = where.partition("#")
        if name != step or (nth and int(nth) != seen):
            continue
        action = action.strip().upper()
        if action == "ENOSPC":
            raise OSError(errno.ENOSPC, "No space left on device (injected)", step)
        if action in ("INT", "KILL", "TERM"):
            os.kill(os.getpid(), getattr(signal, f"SIG{action}"))
            if threading.current_thread() is threading.main_thread():
                import time

                time.sleep(1.0)  # the handler runs here (KeyboardInterrupt for SIGINT)
            if action == "KILL":  # pragma: no cover - the process is gone
                os._exit(137)


def publish_mode(path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """Give a file (0666) or folder (0777) made by mkstemp/mkdtemp the permissions the umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if directory else 0o666) & ~umask)


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, step: str | None = None) -> Path:
    """Write `data` to `path` through a temporary sibling and a rename (a special file is written in place)."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if path.exists() and not path.is_file():  # /dev/stdout, a FIFO: there is nothing to replace
        with open(path, "wb") as fh:
            fh.write(raw)
        return path
    clean_stale(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-{_tag()}-", suffix="")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        publish_mode(tmp)
        if step:
            fault_point(step)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-(?P<host>[0-9a-f]{8})-[A-Za-z0-9_]+$")
_FOREIGN_AGE_S = 24 * 3600


def _tag() -> str:
    """`<pid>-<host>`: who writes a temporary sibling (the host, so a shared volume's other hosts are not judged by pid)."""
    import hashlib
    import socket

    return f"{os.getpid()}-{hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]}"


def _abandoned(entry: Path, pid: int, host: str) -> bool:
    """Whether the process that made `entry` is gone (on another host: whether it is older than a day)."""
    if host != _tag().split("-", 1)[1]:
        try:
            import time

            return time.time() - entry.lstat().st_mtime > _FOREIGN_AGE_S
        except OSError:
            return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by someone else
        return False
    return False


def _siblings(dest: Path, kind: str | None = None):
    if not dest.parent.is_dir():
        return
    for entry in dest.parent.iterdir():
        match = _TEMP.match(entry.name)
        if match is not None and match["name"] == dest.name and kind in (None, match["kind"]):
            yield entry, int(match["pid"]), match["host"]


def clean_stale(dest: str | os.PathLike[str]) -> list[Path]:
    """Remove temporary siblings of `dest` left by processes that died while writing it (with a warning)."""
    dest = Path(dest)
    removed: list[Path] = []
    for entry, pid, host in list(_siblings(dest)):
        if not _abandoned(entry, pid, host):
            continue
        log.warning("removing %s: a half-written copy of %s left by an interrupted process", entry, dest.name)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def temp_dir(dest: str | os.PathLike[str]) -> Path:
    """A fresh, empty temporary sibling folder of `dest` (its parent is created), after cleaning dead ones."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(dest)
    clean_stale(dest)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-{_tag()}-", suffix=""))
    publish_mode(tmp, directory=True)
    return tmp


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the platform or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def install_dir(tmp: str | os.PathLike[str], dest: str | os.PathLike[str], *, step: str | None = None) -> Path:
    """Put the complete folder `tmp` at `dest`; an existing `dest` survives until `tmp` has taken its place."""
    tmp, dest = Path(tmp), Path(dest)
    if step:
        fault_point(f"{step}.install")
    if not dest.exists() and not dest.is_symlink():
        try:
            os.rename(tmp, dest)
            return dest
        except OSError as exc:  # another writer put one there meanwhile: replace it like any other
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    if dest.is_dir() and not dest.is_symlink() and _exchange(tmp, dest):
        old = tmp  # the old folder now lives at the temporary name
    else:
        old = dest.parent / f".{dest.name}.old-{_tag()}-{os.urandom(4).hex()}"
        os.rename(dest, old)
        try:
            if step:
                fault_point(f"{step}.between")
            os.rename(tmp, dest)
        except BaseException:
            if not dest.exists():
                os.rename(old, dest)  # put the old one back; a crash here is undone by recover_dir
            raise
    if step:
        fault_point(f"{step}.cleanup")
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
    return dest


def recover_dir(dest: str | os.PathLike[str]) -> Path | None:
    """Put back a folder that a crash left moved aside (between the two renames of `install_dir`'s fallback)."""
    dest = Path(dest)
    if dest.exists() or not dest.parent.is_dir():
        return None
    for entry, pid, host in sorted(_siblings(dest, "old")):
        if not entry.is_dir() or not _abandoned(entry, pid, host):
            continue
        try:
            os.rename(entry, dest)
        except OSError:  # a read-only place: leave it for a writer to restore
            return None
        log.warning("restored %s from %s (an interrupted replace had moved it aside)", dest, entry.name)
        return dest
    return None
