from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiny_family import ARCHITECTURES, TinyFamily, build_tiny_family


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_families")


@pytest.fixture(scope="session", params=ARCHITECTURES)
def tiny_family(request, tiny_root) -> TinyFamily:
    """A parent/child pair for each tiny architecture."""
    return build_tiny_family(tiny_root, request.param)


@pytest.fixture(scope="session")
def real_family():
    """The bundled SmolLM2 family, built once per machine under ORCHESTRA_HOME (CI builds it first)."""
    from orchestra.family import build_family

    return build_family(home=os.environ.get("ORCHESTRA_HOME"))
