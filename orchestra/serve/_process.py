"""`orchestra serve` as a child process: started on a free port, handed back once it is ready.

Benchmarks, scripts and tests drive the real server as users run it (a separate process, real HTTP); this is
the one place that starts it and waits for `/readyz`, so they all fail the same clear way when it cannot start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ServerProcess", "ServerStartError", "free_port", "start_server"]


class ServerStartError(RuntimeError):
    """The server exited or did not answer `/readyz` in time; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """A running `orchestra serve` child process and where it listens."""

    process: subprocess.Popen[bytes]
    base_url: str
    """``http://host:port`` of the server."""
    log: Path
    """Its stdout and stderr."""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send `sig` and wait for the exit code; kill it (and raise) when it outlives `timeout`."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def start_server(args: Sequence[str], *, log: Path, host: str = "127.0.0.1", env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, timeout: float = 300.0) -> ServerProcess:
    """``python -m orchestra serve --host HOST --port <free> ARGS`` with output to `log`, returned once `/readyz`
    answers 200 (models loaded, executor up). `env` is added to this process's environment."""
    import httpx

    port = free_port(host)
    cmd = [sys.executable, "-m", "orchestra", "serve", "--host", host, "--port", str(port), *args]
    with log.open("wb") as out:  # the child keeps its own descriptor
        process = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=out,
                                   stderr=subprocess.STDOUT)
    server = ServerProcess(process, f"http://{host}:{port}", log)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise ServerStartError(f"orchestra serve exited with {process.returncode}:\n{_tail(log)}")
        try:
            if httpx.get(f"{server.base_url}/readyz", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise ServerStartError(f"orchestra serve was not ready in {timeout:g} s:\n{_tail(log)}")
        time.sleep(0.2)


def _tail(log: Path, chars: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"
