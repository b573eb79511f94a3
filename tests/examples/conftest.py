from __future__ import annotations

from pathlib import Path

import pytest

from orchestra.family.corpus import data_text


@pytest.fixture(scope="session")
def short_document() -> str:
    """The GPL-3 preamble's first lines: about 300 tokens with the prompt layout (cheap on CPU)."""
    return data_text("gpl-3.txt")[:1200]


@pytest.fixture
def short_document_file(tmp_path: Path, short_document: str) -> Path:
    path = tmp_path / "gpl-3-head.txt"
    path.write_text(short_document, encoding="utf-8")
    return path
