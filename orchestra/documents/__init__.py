"""Documents and chunking: the text every run shares, read from a file and cut to a model's window.

Owns reading the formats people analyse (plain text, Markdown, PDF, HTML, DOCX) into one text,
reading and writing users' files with typed errors, splitting a document longer than a window into
overlapping chunks, and the texts that ship with the bundled family.

May import: ``orchestra.errors`` and libraries (pypdf and friends load only for their format).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestra._exports import lazy_exports

if TYPE_CHECKING:
    from orchestra.documents.chunking import Chunk, prefix_tokens, select_chunks, split_document
    from orchestra.documents.files import decode_text, read_text_file, write_output
    from orchestra.documents.formats import Anchor, Document, DocumentKind, load_document, sniff_kind
    from orchestra.documents.texts import CALIBRATION_TEXTS, HELDOUT_TEXT, data_text

__all__ = [
    "Document",
    "Anchor",
    "DocumentKind",
    "load_document",
    "sniff_kind",
    "read_text_file",
    "decode_text",
    "write_output",
    "Chunk",
    "split_document",
    "prefix_tokens",
    "select_chunks",
    "HELDOUT_TEXT",
    "CALIBRATION_TEXTS",
    "data_text",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "orchestra.documents.chunking": (
            "Chunk",
            "prefix_tokens",
            "select_chunks",
            "split_document",
        ),
        "orchestra.documents.files": (
            "decode_text",
            "read_text_file",
            "write_output",
        ),
        "orchestra.documents.formats": (
            "Anchor",
            "Document",
            "DocumentKind",
            "load_document",
            "sniff_kind",
        ),
        "orchestra.documents.texts": (
            "CALIBRATION_TEXTS",
            "HELDOUT_TEXT",
            "data_text",
        ),
    },
)
