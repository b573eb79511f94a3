"""Text corpora that are on every machine or ship with the project.

Kept apart on purpose: the fine-tuned member learns on stdlib docstrings, divergence is
measured on the GPL text, and mapping calibration uses the other licence texts, so no
evaluation text was ever seen in training or calibration.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

__all__ = ["DATA_DIR", "stdlib_docstrings", "data_text", "HELDOUT_TEXT", "CALIBRATION_TEXTS"]

DATA_DIR = Path(__file__).parent / "data"
HELDOUT_TEXT = "gpl-3.txt"
CALIBRATION_TEXTS = ("mpl-2.0.txt", "apache-2.0.txt", "gfdl-1.3.txt")


def data_text(name: str) -> str:
    """A text shipped in orchestra/family/data."""
    return (DATA_DIR / name).read_text(encoding="utf-8")


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
