from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from orchestra.family.corpus import data_text
from tests.waiting import HANG_GUARD_S

if TYPE_CHECKING:
    from orchestra.serve import ServerProcess


@pytest.fixture(scope="session")
def short_document() -> str:
    """The GPL-3 preamble's first lines: about 300 tokens with the prompt layout (cheap on CPU)."""
    return data_text("gpl-3.txt")[:1200]


@pytest.fixture
def short_document_file(tmp_path: Path, short_document: str) -> Path:
    path = tmp_path / "gpl-3-head.txt"
    path.write_text(short_document, encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory) -> Path:
    """A family home laid out like the bundled one (root, finetuned, quantized, distilled, int8), its members
    derived from a tiny llama model with a 4,096-token context: the examples' servers and graphs run on it in
    seconds. No mapping is calibrated in it."""
    from tests.tiny_family import build_tiny_home

    return build_tiny_home(tmp_path_factory.mktemp("examples_tiny_home"))


@pytest.fixture(scope="session")
def tiny_server(tiny_home, tmp_path_factory) -> Iterator[ServerProcess]:
    """`orchestra serve` over the tiny home on a free port, as users start it (a process of its own, CPU), with
    ``--on-missing-mapping calibrate``: the first request that needs root -> a member fits that map (seconds on
    the tiny models), so a conversation moving to another member gets a mapped cache."""
    from orchestra.serve import start_server

    server = start_server(["--home", str(tiny_home), "--device", "cpu", "--on-missing-mapping", "calibrate"],
                          log=tmp_path_factory.mktemp("tiny_server") / "server.log", timeout=HANG_GUARD_S)
    yield server
    server.stop(timeout=HANG_GUARD_S)
