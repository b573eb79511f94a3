"""Fixtures of the server tests: a ServeEngine over a tiny family (seconds, no download) and a live
`orchestra serve` subprocess over the bundled family."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from orchestra.family.manifest import FamilyManifest, MemberRecord
from orchestra.familycache import CachePolicy, FamilyCache
from orchestra.mapstore import MappingStore
from orchestra.registry import ModelRegistry
from orchestra.serve import ServeConfig, ServeEngine
from tests.tiny_family import build_tiny_family

ROOT = Path(__file__).resolve().parents[3]


# -- a tiny family behind the engine -------------------------------------------------------------
@dataclass(frozen=True)
class TinyServeFamily:
    manifest: FamilyManifest
    registry: ModelRegistry
    mappings: MappingStore


@pytest.fixture(scope="session")
def tiny_serve_family(tiny_root, tmp_path_factory) -> TinyServeFamily:
    """The llama tiny pair as a two-member family (root and finetuned); no mapping, so no calibration."""
    fam = build_tiny_family(tiny_root, "llama")

    def record(name: str, role: str, path: Path, parent: str | None = None) -> MemberRecord:
        return MemberRecord(name=name, role=role, path=str(path), parent=parent, fingerprint={"combined": name},
                            num_layers=4, num_parameters=0, bytes=0)

    manifest = FamilyManifest(family="tiny", home=str(tiny_root), members={
        "tiny-parent": record("tiny-parent", "root", fam.parent),
        "tiny-child": record("tiny-child", "finetuned", fam.child, parent="tiny-parent"),
    })
    registry = ModelRegistry({"root": str(fam.parent), "finetuned": str(fam.child)}, default_device="cpu")
    mappings = MappingStore(tmp_path_factory.mktemp("tiny_serve_maps"), on_missing="refuse")
    return TinyServeFamily(manifest, registry, mappings)


def tiny_engine(family: TinyServeFamily, **config) -> ServeEngine:
    """A ServeEngine over the tiny family (models shared between engines, each with its own cache)."""
    cfg = ServeConfig(device="cpu", **config)
    cache = FamilyCache(family.registry, family.mappings, source="root",
                        policy=CachePolicy(budget_bytes=cfg.cache_mb << 20, gate=cfg.gate, tail_tokens=cfg.tail_tokens))
    return ServeEngine(cfg, family=family.manifest, cache=cache)


# -- a live server over the bundled family ---------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    process: subprocess.Popen
    base_url: str
    log: Path

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus sample over the series matching `labels`."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
            if not match:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(match.group(2))
        return total

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.metric("orchestra_running_generations") > 0:
            assert time.monotonic() < deadline, "the server still runs a generation"
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def start_server(home: str | os.PathLike[str], log: Path, *args: str, env: dict[str, str] | None = None,
                 timeout: float = 180.0) -> LiveServer:
    """`python -m orchestra serve` on a free 127.0.0.1 port, once /readyz answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "orchestra", "serve", "--home", str(home), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", *args]
    out = log.open("w")
    process = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
    server = LiveServer(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"orchestra serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{server.base_url}/readyz", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"orchestra serve was not ready in {timeout:g} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


@pytest.fixture
def server_factory(tmp_path) -> Iterator:
    """Start servers inside a test; every one still running at the end is stopped."""
    started: list[LiveServer] = []

    def start(home, *args: str, env: dict[str, str] | None = None) -> LiveServer:
        server = start_server(home, tmp_path / f"server{len(started)}.log", *args, env=env)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
