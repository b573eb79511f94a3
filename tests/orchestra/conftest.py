"""Fixtures shared by the orchestra tests: one tiny llama family and one mapping store for the session."""

from __future__ import annotations

import pytest

from orchestra.family.corpus import data_text
from orchestra.familycache.mapping_store import MappingStore
from tests.tiny_family import build_tiny_family


@pytest.fixture(scope="session")
def fam(tiny_root):
    """A tiny llama parent/child pair (built once per session)."""
    return build_tiny_family(tiny_root, "llama")


@pytest.fixture(scope="session")
def mapstore(tmp_path_factory):
    """A mapping store calibrating on demand from two licence texts (each pair calibrated once per session)."""
    corpus = [("mpl", data_text("mpl-2.0.txt")[:6000]), ("apache", data_text("apache-2.0.txt")[:6000])]
    return MappingStore(tmp_path_factory.mktemp("maps"), tokens=2048, corpus=corpus)
