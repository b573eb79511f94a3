"""Run `orchestra` commands in child processes that die at a chosen write step (the crash tests' engine).

`Zygote` starts one helper process that imports torch, transformers and the CLI once, then forks a
fresh child per command (no torch work happens before the fork, so forking is safe). Each child runs
the real CLI with ``$ORCHESTRA_FAULT`` set (`mappings.atomic.fault_point`), so it sends itself SIGINT
or SIGKILL, or fails as a full disk, exactly at that write step. The parent reports how the child
ended. This keeps a crash test at the cost of the command itself, not of a Python start-up.

`tiny_build_patches` makes `orchestra family build` build the bundled family's four members from a
tiny model instead of the SmolLM2 GGUF (the write path, the only thing the crash tests exercise,
is the real one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.waiting import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]


def tiny_build_patches(parent: str | os.PathLike[str]) -> list[tuple[Any, str, Any]]:
    """(object, attribute, value) triples that make `build_family` derive every member from `parent`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import orchestra.family._gguf as gguf
    import orchestra.family.build as build
    import orchestra.family.divergence as divergence

    parent = str(parent)

    def locate(home, explicit=None, allow_download=True):
        return Path(parent) / "config.json"

    def load(path):
        return (AutoModelForCausalLM.from_pretrained(parent, dtype=torch.float32).eval(),
                AutoTokenizer.from_pretrained(parent))

    def derive(spec, root_dir):
        model = AutoModelForCausalLM.from_pretrained(str(root_dir), dtype=torch.float32)
        gen = torch.Generator().manual_seed(sum(map(ord, spec.role)))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
        model.config.name_or_path = spec.name
        return model.eval()

    return [(gguf, "locate_gguf", locate), (gguf, "load_gguf", load), (build, "_derive", derive),
            (divergence, "heldout_windows", lambda *a, **k: None),
            (divergence, "measure_divergence", lambda model, heldout: (0.01, 0.9, 16))]


def _child(job: dict[str, Any]) -> None:  # pragma: no cover - runs in the forked child
    os.environ.update(job.get("env", {}))
    if job.get("tiny_build"):
        for obj, name, value in tiny_build_patches(job["tiny_build"]):
            setattr(obj, name, value)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from orchestra.cli import app

    try:
        app(job["argv"], prog_name="orchestra")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - report it like an uncaught exception would
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve() -> None:  # pragma: no cover - the helper process
    import torch  # noqa: F401 - imported once, before any fork
    import transformers  # noqa: F401

    import orchestra.cli  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        out = Path(job["log"])
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            _child(job)
        _, status = os.waitpid(pid, 0)
        result = {"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                  "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                  "seconds": time.perf_counter() - started}
        print(json.dumps(result), flush=True)


class Zygote:
    """The helper process: `run(argv, fault=...)` forks a child for one CLI command and says how it ended."""

    def __init__(self, workdir: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("ORCHESTRA_FAULT", None)
        self.workdir = workdir
        self.count = 0
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fault_driver"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError("the fault-injection helper did not start")

    def run(self, argv: list[str], *, fault: str | None = None, env: dict[str, str] | None = None,
            tiny_build: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        self.count += 1
        log = self.workdir / f"child-{self.count}.log"
        job_env = dict(env or {})
        if fault:
            job_env["ORCHESTRA_FAULT"] = fault
        job = {"argv": [str(a) for a in argv], "env": job_env, "log": str(log),
               "tiny_build": str(tiny_build) if tiny_build else None}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fault-injection helper died")
        result = json.loads(line)
        result["output"] = log.read_text(errors="replace")
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":  # pragma: no cover
    _serve()
