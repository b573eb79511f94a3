"""Reading user input files as text and writing outputs, with typed errors that say what to do.

A document that is not text (NUL bytes, mostly control bytes: an executable, an image) is told apart
from text in another encoding: the first is refused as binary, the second names the byte that is not
UTF-8 and the ``--encoding`` option that reads it. Outputs are written through a temporary sibling and
a rename (`mappings.atomic.write_atomic`), so a failed write (a full disk) never leaves half a report.
"""

from __future__ import annotations

import codecs
import errno
import os
from pathlib import Path

from orchestra.errors import InputFileError, OutputError

__all__ = ["read_text_file", "decode_text", "write_output", "looks_binary"]

_TEXT_CONTROLS = {9, 10, 12, 13, 8, 27}
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def looks_binary(raw: bytes) -> bool:
    """True for data that is not text in any encoding: a NUL byte, or many control bytes, in its first 8 KiB."""
    head = raw[:8192]
    if not head:
        return False
    if b"\x00" in head:
        return True
    controls = sum(1 for b in head if b < 32 and b not in _TEXT_CONTROLS)
    return controls > len(head) * 0.1


def read_text_file(path: str | os.PathLike[str], *, encoding: str | None = None, what: str = "document") -> str:
    """The text of a file; `encoding` None reads UTF-8 (a BOM selects UTF-8/16/32). Raises `InputFileError`."""
    path = Path(path)
    if not path.exists():
        raise InputFileError(f"{what} {path} does not exist")
    if path.is_dir():
        raise InputFileError(f"{what} {path} is a folder; pass a text file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputFileError(f"cannot read {what} {path}: {exc.strerror or exc}; pass a readable text file") from exc
    return decode_text(raw, f"{what} {path}", encoding=encoding)


def decode_text(raw: bytes, where: str, *, encoding: str | None = None) -> str:
    """Bytes as text by `read_text_file`'s rules; `where` names them in errors (e.g. ``document notes.txt``)."""
    if encoding is not None:
        try:
            codecs.lookup(encoding)
        except LookupError as exc:
            raise InputFileError(f"unknown encoding {encoding!r}; use a Python codec name such as utf-8, "
                                 "latin-1 or cp1252") from exc
        try:
            return raw.decode(encoding)
        except UnicodeDecodeError as exc:
            raise InputFileError(f"{where} is not valid {encoding} (byte 0x{raw[exc.start]:02x} at offset "
                                 f"{exc.start}); pass the file's real encoding with --encoding") from exc
    bom = next((name for mark, name in _BOMS if raw.startswith(mark)), None)
    if bom is not None:
        try:
            return raw.decode(bom)
        except UnicodeDecodeError as exc:
            raise InputFileError(f"{where} starts with a {bom} byte-order mark but is not valid {bom}; "
                                 "pass its encoding with --encoding") from exc
    if looks_binary(raw):
        raise InputFileError(f"{where} is a binary file, not text; pass a text file, or a PDF, HTML or DOCX "
                             "document (read by format), or convert it to plain text first")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(
            f"{where} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); if it is text "
            "in another encoding, pass it with --encoding (for example --encoding latin-1 or cp1252)"
        ) from exc


def write_output(path: str | os.PathLike[str], text: str, *, what: str = "report") -> Path:
    """Write `text` to `path` crash-safely (parents created); any failure is an `OutputError` naming the fix."""
    from mappings.atomic import write_atomic

    path = Path(path)
    if path.is_dir():
        raise OutputError(f"cannot write the {what} to {path}: it is a folder; pass a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(path, text)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            hint = "free some disk space or choose another path"
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            hint = "choose a writable path"
        else:
            hint = "choose another path"
        raise OutputError(f"cannot write the {what} to {path}: {exc.strerror or exc}; {hint}") from exc
