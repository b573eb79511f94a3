"""Documents in the formats people analyse: plain text, Markdown, PDF, HTML and DOCX, read into one text.

    doc = load_document("contract.pdf")        # a path, the file's bytes, or the text itself
    doc.text                                   # what the agents read, with its anchors written in:
    doc.anchors                                # "[page 3]" lines, Markdown headings ("## Termination")

The anchors stay in the text so an agent can cite them ("see [page 3]", "under ## Termination"), and
`Document.anchor_at(offset)` says which page or section a span of the text came from. Each format is
read by a kept library (PDF: pypdf; HTML: trafilatura, which drops navigation, footers and other
boilerplate; DOCX: python-docx), imported only when a document of that format is read; they come with
the ``documents`` extra. What cannot be read (an encrypted PDF, a scan without a text layer, a damaged
file, a page with no main text) raises `DocumentFormatError` with one line saying what to do.
"""

from __future__ import annotations

import io
import os
import re
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Literal

from orchestra.errors import DocumentFormatError, InputFileError

__all__ = ["Document", "Anchor", "DocumentKind", "load_document", "sniff_kind"]

DocumentKind = Literal["text", "markdown", "pdf", "html", "docx"]

_SUFFIXES: dict[str, DocumentKind] = {
    ".txt": "text", ".text": "text", ".md": "markdown", ".markdown": "markdown", ".pdf": "pdf", ".html": "html",
    ".htm": "html", ".xhtml": "html", ".docx": "docx",
}
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Anchor:
    """A place in the document's text an output can cite: a page start or a heading."""

    offset: int
    """Character offset in `Document.text` where it starts."""
    label: str
    """As written in the text: ``[page 3]`` or ``## Termination``."""
    kind: Literal["page", "heading"]


@dataclass(frozen=True)
class Document:
    """A document's text as the agents read it, what it was read from, and its anchors."""

    text: str
    kind: DocumentKind
    source: str = "<text>"
    anchors: tuple[Anchor, ...] = field(default_factory=tuple)
    pages: int | None = None
    """PDF: pages in the file (pages without text included)."""

    def anchor_at(self, offset: int, kind: Literal["page", "heading"] | None = None) -> Anchor | None:
        """The last anchor (of `kind`, or any) at or before `offset`: the page or section it lies in."""
        anchors = [a for a in self.anchors if kind is None or a.kind == kind]
        i = bisect_right([a.offset for a in anchors], offset)
        return anchors[i - 1] if i else None


def sniff_kind(raw: bytes, name: str | None = None) -> DocumentKind:
    """A document's format from its first bytes, else its file name's suffix, else text."""
    head = raw[:2048].lstrip()
    if head.startswith(b"%PDF-"):
        return "pdf"
    if head.startswith(b"PK\x03\x04") and b"word/" in raw[:65536]:
        return "docx"
    lowered = head[:512].lower()
    if lowered.startswith((b"<!doctype html", b"<html")) or b"<html" in lowered:
        return "html"
    if name is not None:
        by_suffix = _SUFFIXES.get(Path(name).suffix.lower())
        if by_suffix is not None:
            return by_suffix
    return "text"


def load_document(source: str | os.PathLike[str] | bytes, *, encoding: str | None = None,
                  kind: DocumentKind | None = None, name: str | None = None) -> Document:
    """Read a document: a path (str paths must be `os.PathLike`; a `str` is the text itself), or a file's bytes.

    `kind` overrides what the bytes and the name say; `encoding` is for text, Markdown and HTML without a
    declared charset (default: UTF-8, a BOM, or what the HTML declares).
    """
    if isinstance(source, str):
        return _from_text(source, kind or ("markdown" if _HEADING.search(source) else "text"), name or "<text>")
    if isinstance(source, os.PathLike):
        path = Path(source)
        raw = _read_bytes(path)
        name = name or str(path)
    else:
        raw = bytes(source)
        name = name or "<bytes>"
    kind = kind or sniff_kind(raw, name)
    if kind == "pdf":
        return _pdf(raw, name)
    if kind == "docx":
        return _docx(raw, name)
    if kind == "html":
        return _html(raw, name, encoding)
    return _from_text(_decode(raw, name, encoding), kind, name)


# -- formats -----------------------------------------------------------------------------------------------
def _from_text(text: str, kind: DocumentKind, name: str) -> Document:
    anchors = tuple(Anchor(m.start(), m.group(0).strip(), "heading") for m in _HEADING.finditer(text))
    return Document(text, kind, name, anchors if kind != "text" else ())


def _pdf(raw: bytes, name: str) -> Document:
    pypdf = _need("pypdf", "PDF")
    from pypdf.errors import PdfReadError

    try:
        reader = pypdf.PdfReader(io.BytesIO(raw))
        if reader.is_encrypted:
            try:
                opened = reader.decrypt("")  # many "encrypted" PDFs only restrict printing: empty user password
            except Exception:
                opened = 0
            if not opened:
                raise DocumentFormatError(f"{name} is an encrypted PDF: decrypt it first (e.g. `qpdf --decrypt "
                                          "--password=... in.pdf out.pdf`) and pass the decrypted file")
        pages = [page.extract_text() or "" for page in reader.pages]
    except DocumentFormatError:
        raise
    except (PdfReadError, ValueError, KeyError, TypeError, OSError) as exc:
        raise DocumentFormatError(f"{name} is not a readable PDF ({type(exc).__name__}: {exc}); pass an "
                                  "undamaged copy") from exc
    if not any(p.strip() for p in pages):
        raise DocumentFormatError(f"{name} has no text layer ({len(pages)} pages, scanned images?): run OCR on it "
                                  "first (e.g. `ocrmypdf in.pdf out.pdf`) and pass the result")
    parts: list[str] = []
    anchors: list[Anchor] = []
    offset = 0
    for number, page in enumerate(pages, 1):
        body = _tidy(page)
        if not body:
            continue  # an empty page: nothing to cite
        label = f"[page {number}]"
        block = f"{label}\n{body}\n\n"
        anchors.append(Anchor(offset, label, "page"))
        parts.append(block)
        offset += len(block)
    return Document("".join(parts).rstrip() + "\n", "pdf", name, tuple(anchors), pages=len(pages))


def _html(raw: bytes, name: str, encoding: str | None) -> Document:
    trafilatura = _need("trafilatura", "HTML")
    html: str | bytes = raw.decode(encoding) if encoding else raw  # bytes: trafilatura reads the declared charset
    try:
        text = trafilatura.extract(html, output_format="markdown", include_tables=True, include_comments=False,
                                   include_links=False, favor_recall=True)
    except Exception as exc:  # lxml and the extractors raise many kinds on damaged markup
        raise DocumentFormatError(f"{name} could not be read as HTML ({type(exc).__name__}: {exc}); save the page "
                                  "again or pass its text") from exc
    if not text or not text.strip():
        raise DocumentFormatError(f"{name} has no main text (an empty page, or one drawn by scripts): save the "
                                  "rendered page's text and pass that")
    return _from_text(_tidy(text) + "\n", "html", name)


def _docx(raw: bytes, name: str) -> Document:
    docx = _need("docx", "DOCX", package="python-docx")
    try:
        document = docx.Document(io.BytesIO(raw))
    except Exception as exc:  # a damaged zip or XML part
        raise DocumentFormatError(f"{name} is not a readable DOCX file ({type(exc).__name__}: {exc}); pass an "
                                  "undamaged copy") from exc
    lines: list[str] = []
    for paragraph in document.paragraphs:
        text = paragraph.text.strip()
        if not text:
            continue
        style = (paragraph.style.name or "") if paragraph.style is not None else ""
        match = re.match(r"Heading (\d)", style)
        lines.append(f"{'#' * int(match.group(1))} {text}" if match else text)
    for table in document.tables:
        for row in table.rows:
            lines.append(" | ".join(cell.text.strip() for cell in row.cells))
    if not lines:
        raise DocumentFormatError(f"{name} has no text")
    return _from_text("\n\n".join(lines) + "\n", "docx", name)


# -- helpers -------------------------------------------------------------------------------------------------
def _read_bytes(path: Path) -> bytes:
    if not path.exists():
        raise InputFileError(f"document {path} does not exist")
    if path.is_dir():
        raise InputFileError(f"document {path} is a folder; pass a file")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputFileError(f"cannot read document {path}: {exc.strerror or exc}; pass a readable file") from exc


def _decode(raw: bytes, name: str, encoding: str | None) -> str:
    """Text from bytes with the rules of `orchestra.documents.files.read_text_file` (binary refused, --encoding named)."""
    from orchestra.documents.files import decode_text

    return decode_text(raw, f"document {name}", encoding=encoding)


def _tidy(text: str) -> str:
    """Trailing spaces dropped, runs of blank lines made one."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _need(module: str, what: str, *, package: str | None = None) -> ModuleType:
    """Import a format's library, or say which install brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        from orchestra.errors import install_command

        raise DocumentFormatError(f"reading {what} documents needs {package or module}, which is not installed: "
                                  f"{install_command('documents')}") from exc
