from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The suite runs one worker per core (README's test command): a worker's torch keeping to one thread
    # leaves the other core to the other worker instead of both oversubscribing both cores. Set before
    # anything imports torch, and inherited by the servers and CLIs the tests start.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from tests.tiny_family import ARCHITECTURES, TinyFamily, build_tiny_family

# Runs keep document caches on disk by default (in the orchestra home). Tests must neither write into the home
# of the machine they run on nor see one test's caches in another's cold run: the disk tier is off unless a
# test names its own folder (the tests of the disk tier do; subprocesses inherit this).
os.environ.setdefault("ORCHESTRA_KV_STORE", "off")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_families")


@pytest.fixture(scope="session", params=ARCHITECTURES)
def tiny_family(request, tiny_root) -> TinyFamily:
    """A parent/child pair for each tiny architecture."""
    return build_tiny_family(tiny_root, request.param)


@pytest.fixture(scope="session")
def real_family():
    """The bundled SmolLM2 family, built once per machine under ORCHESTRA_HOME (CI builds it first).

    Calibrates no mappings itself (a full build calibrates all four pairs at 8192 tokens, minutes on
    CI): only the one pair the tests need, at 4096 tokens, and only when it is missing.
    """
    from orchestra.family import build_family

    with _every_core():
        family = build_family(home=os.environ.get("ORCHESTRA_HOME"), calibrate=False)
        _ensure_mapping(family, "finetuned")
    return family


@contextmanager
def _every_core():
    """Torch on every core for the block: a first build of the family is minutes of one worker's work, and the
    other worker, once it needs the family too, waits on the build's lock with its core idle."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _ensure_mapping(family, role: str, tokens: int = 4096) -> None:
    """The root -> `role` mapping in the family's store, calibrated once per machine when missing.

    The serving and chat tests assert that a member is served a *mapped* cache from the root; on a
    fresh machine nothing has calibrated that pair yet (the demo and `orchestra family calibrate` do).
    """
    import warnings
    from pathlib import Path

    from orchestra.familycache.mapping_store import MappingStore
    from orchestra.models.registry import ModelRegistry

    registry = ModelRegistry({"root": "root", role: role}, family=family, default_device="cpu")
    store = MappingStore(Path(family.home) / "mappings", tokens=tokens)
    if store.has(registry.info("root"), registry.info(role)):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "calibrating on demand" is the point here
        store.get(registry.load("root"), registry.load(role))


@pytest.fixture(scope="session")
def tiny_family_home(tiny_root) -> Path:
    """A family home built by `build_family` whose four members derive from the tiny llama model (not the GGUF)."""
    from tests.tiny_family import build_home_from

    fam = build_tiny_family(tiny_root, "llama")
    return build_home_from(fam.parent, tiny_root / "family-home")  # each test calibrates what it needs
