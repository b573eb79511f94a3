"""Text corpora that are on every machine or ship with the project.

Kept apart on purpose: the fine-tuned member learns on stdlib docstrings, divergence is
measured on the GPL text, and mapping calibration uses the other licence texts, so no
evaluation text was ever seen in training or calibration.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

# The shipped texts are named in orchestra.documents.texts, which the runtime mapping store reads too.
from orchestra.documents.texts import CALIBRATION_TEXTS, DATA_DIR, HELDOUT_TEXT, data_text

__all__ = ["DATA_DIR", "stdlib_docstrings", "data_text", "training_text", "HELDOUT_TEXT", "CALIBRATION_TEXTS"]


def stdlib_docstrings(max_chars: int = 400_000, min_len: int = 200) -> str:
    """Docstrings of the Python standard library, in a fixed order, parsed (never imported)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[str] = []
    total = 0
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    files += sorted(p for p in root.glob("*/*.py") if "test" not in p.parts[-2] and not p.name.startswith("_"))
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_len:
                    chunks.append(doc.strip())
                    total += len(doc) + 2
                    if total >= max_chars:
                        return "\n\n".join(chunks)
    return "\n\n".join(chunks)


def training_text(corpus: str) -> str:
    """A training corpus by name: ``+``-joined parts, ``stdlib_docstrings`` and/or ``licences``.

    ``licences`` is the calibration licence texts (MPL, Apache, GFDL): English prose of the kind the
    demo document is, but never the held-out GPL text the divergence is measured on.
    """
    parts = []
    for part in corpus.split("+"):
        if part == "stdlib_docstrings":
            parts.append(stdlib_docstrings())
        elif part == "licences":
            parts.extend(data_text(name) for name in CALIBRATION_TEXTS if name != HELDOUT_TEXT)
        else:
            raise ValueError(f"unknown training corpus part {part!r}; use stdlib_docstrings and/or licences")
    return "\n\n".join(parts)
