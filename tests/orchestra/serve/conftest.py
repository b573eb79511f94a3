"""Fixtures of the server tests: a ServeEngine over a tiny family (seconds, no download) and a live
`orchestra serve` subprocess over the bundled family."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from orchestra.family.manifest import FamilyManifest, MemberRecord
from orchestra.familycache import CachePolicy, FamilyCache
from orchestra.familycache.mapping_store import MappingStore
from orchestra.models.registry import ModelRegistry
from orchestra.serve import ServeConfig, ServeEngine, ServerProcess, create_app
from orchestra.serve import start_server as launch
from tests.tiny_family import build_tiny_family
from tests.waiting import HANG_GUARD_S, poll_until, wait_until

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
                        policy=CachePolicy(budget_bytes=cfg.cache_budget_bytes(), gate=cfg.gate, tail_tokens=cfg.tail_tokens))
    return ServeEngine(cfg, family=family.manifest, cache=cache)


# -- pipeline runs over HTTP on the tiny family --------------------------------------------------------
@pytest.fixture(scope="module")
def runs_engine(tiny_serve_family, tmp_path_factory) -> ServeEngine:
    """An engine with a pipelines folder holding `qa` (one input, `question`) and room for two runs at once."""
    folder = tmp_path_factory.mktemp("pipelines")
    (folder / "qa.yaml").write_text(
        "models: {root: root}\ninputs: [question]\n"
        "agents:\n  - {name: answer, model: root, spec: {task: 'Answer: {question}', generation: {max_new_tokens: 3}}}\n")
    return tiny_engine(tiny_serve_family, pipelines_dir=folder, max_runs=2)


@contextlib.asynccontextmanager
async def asgi_client(engine: ServeEngine) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the app over `engine`, in process (no socket)."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine=engine)),
                                 base_url="http://test", timeout=HANG_GUARD_S) as client:
        yield client


@pytest.fixture
async def runs_client(runs_engine) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(runs_engine) as client:
        yield client


async def finish_run(client: httpx.AsyncClient, run_id: str) -> dict:
    """The run's status once it has ended (waiting as long as it runs; a hang guard only)."""
    async def status() -> dict:
        return (await client.get(f"/v1/runs/{run_id}")).json()

    return await poll_until(status, lambda s: s["status"] != "running", what=f"run {run_id} to end")


# -- a live server over the bundled family ---------------------------------------------------------
class LiveServer(ServerProcess):
    """The server process with the probes tests use: its metrics, waiting for idle."""

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus sample over the series matching `labels`."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=HANG_GUARD_S).text
        total = 0.0
        for line in text.splitlines():
            match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
            if not match:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(match.group(2))
        return total

    def wait_idle(self) -> None:
        wait_until(lambda: self.metric("orchestra_running_generations") == 0, what="the server to finish its "
                   "generations", alive=self.process)


def start_server(home: str | os.PathLike[str], log: Path, *args: str, env: dict[str, str] | None = None,
                 timeout: float = HANG_GUARD_S) -> LiveServer:
    """`python -m orchestra serve` over `home` on a free 127.0.0.1 port, once /readyz answers 200 (a server that
    exits first fails at once; `timeout` only guards against a hang)."""
    started = launch(["--home", str(home), "--device", "cpu", *args], log=log, env=env, cwd=ROOT, timeout=timeout)
    return LiveServer(started.process, started.base_url, started.log)


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
