"""`orchestra serve`: the OpenAI-compatible server over the family."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=False)


@app.command("serve")
def serve(
    ctx: typer.Context,
    models: Annotated[list[str] | None, typer.Argument(metavar="MODEL", help="Serve these models (folders or Hub "
                      "ids org/name@revision, optionally name=MODEL; the first is the root) as a family, without "
                      "`orchestra family init`: initialised once under <home>/served/, reused after. Unset: the "
                      "family of --home.", show_default=False)] = None,
    home: Annotated[Path | None, typer.Option("--home", help="Family home (default: $ORCHESTRA_HOME or ~/.cache/orchestra).")] = None,
    host: Annotated[str, typer.Option("--host", envvar="ORCHESTRA_HOST", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", envvar="ORCHESTRA_PORT", min=0, max=65535, help="Port to listen on.")] = 8000,
    device: Annotated[str, typer.Option("--device", envvar="ORCHESTRA_DEVICE", help="'cpu', 'cuda:N' or 'auto' for every member.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", envvar="ORCHESTRA_DTYPE", help="auto (bfloat16 on CUDA that supports it, float32 on CPU), "
                                       "float32, bfloat16 or float16.")] = "auto",
    source: Annotated[str, typer.Option("--source", envvar="ORCHESTRA_SOURCE", help="Member whose mappings to the others are tried first.")] = "root",
    api_key_env: Annotated[str | None, typer.Option("--api-key-env", envvar="ORCHESTRA_API_KEY_ENV", help="Environment variable holding the Bearer key (unset: no auth).")] = None,
    cache_mb: Annotated[int, typer.Option("--cache-mb", envvar="ORCHESTRA_CACHE_MB", min=1, help="Memory beyond the models, MiB: prefix cache, decoding replies and builds, and the runtime reserve.")] = 2048,
    runtime_reserve_mb: Annotated[int, typer.Option("--runtime-reserve-mb", envvar="ORCHESTRA_RUNTIME_RESERVE_MB", min=0, help="Of --cache-mb, MiB kept for the server's own working memory (at most a quarter).")] = 128,
    max_concurrent: Annotated[int, typer.Option("--max-concurrent", envvar="ORCHESTRA_MAX_CONCURRENT", min=1, help="Generations running at once.")] = 8,
    max_queue: Annotated[int, typer.Option("--max-queue", envvar="ORCHESTRA_MAX_QUEUE", min=0, help="Requests waiting for a slot before 429.")] = 64,
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", envvar="ORCHESTRA_MAX_BODY_MB", min=0.001, help="Largest request body, MiB (413 beyond).")] = 4.0,
    request_timeout: Annotated[float, typer.Option("--request-timeout", envvar="ORCHESTRA_REQUEST_TIMEOUT", min=0.1, help="Seconds before a request is stopped (504).")] = 300.0,
    max_tokens_limit: Annotated[int, typer.Option("--max-tokens-limit", envvar="ORCHESTRA_MAX_TOKENS_LIMIT", min=1, help="Largest max_tokens a request may ask for.")] = 4096,
    default_max_tokens: Annotated[int, typer.Option("--default-max-tokens", envvar="ORCHESTRA_DEFAULT_MAX_TOKENS", min=1, help="Completion tokens when a request gives none.")] = 256,
    repair_ladder: Annotated[str | None, typer.Option("--repair-ladder", envvar="ORCHESTRA_REPAIR_LADDER", help="Comma-separated repair budgets "
                             "(shares of a prefill, e.g. 0.02,0.05,0.1,0.2) climbed until a map passes the probe gate "
                             "instead of re-prefilling (docs/repair.md); unset: pure maps.")] = None,
    batch: Annotated[bool, typer.Option("--batch/--no-batch", envvar="ORCHESTRA_BATCH", help="Decode the requests on one member together (step-level batching).")] = True,
    max_batch: Annotated[int, typer.Option("--max-batch", envvar="ORCHESTRA_MAX_BATCH", min=1, help="Rows in one member's decoding batch.")] = 8,
    inline_tail: Annotated[int, typer.Option("--inline-tail", envvar="ORCHESTRA_INLINE_TAIL", min=0, help="A prompt whose uncached rest is at most "
                           "this many tokens leases the cached part and computes the rest while decoding (stores "
                           "nothing of its own); 0: cache every prompt whole.")] = 256,
    pipelines: Annotated[Path | None, typer.Option("--pipelines", envvar="ORCHESTRA_PIPELINES", help="A folder of pipeline files that POST /v1/runs "
                         "runs by name (its file's stem); unset: inline pipelines only.")] = None,
    max_runs: Annotated[int, typer.Option("--max-runs", envvar="ORCHESTRA_MAX_RUNS", min=1, help="Pipeline runs (POST /v1/runs) at once; more get "
                        "429.")] = 4,
    kv_store: Annotated[Path | None, typer.Option("--kv-store", envvar="ORCHESTRA_KV_STORE", help="Keep caches on disk in this folder and read "
                        "them back after a restart (e.g. <home>/kv, shared with `orchestra run`); unset: memory only.")] = None,
    kv_store_mb: Annotated[int, typer.Option("--kv-store-mb", envvar="ORCHESTRA_KV_STORE_MB", min=1, help="Bytes the disk tier may hold, MiB.")] = 8192,
    on_missing_mapping: Annotated[str, typer.Option("--on-missing-mapping", envvar="ORCHESTRA_ON_MISSING_MAPPING", help="refuse (re-prefill) or calibrate (minutes, inside the request).")] = "refuse",
    log_format: Annotated[str, typer.Option("--log-format", envvar="ORCHESTRA_LOG_FORMAT", help="json (one object per line) or console.")] = "json",
    graceful_s: Annotated[float, typer.Option("--graceful-shutdown", envvar="ORCHESTRA_GRACEFUL_SHUTDOWN", min=0.0, help="Seconds in-flight requests get on shutdown.")] = 30.0,
    executor: Annotated[str, typer.Option("--executor", envvar="ORCHESTRA_EXECUTOR", help="Where the models run: local, ray, or a pipeline-style "
                                          "executor mapping as JSON/YAML, e.g. '{kind: ray, members: {root: {replicas: 2}}}'.")] = "local",
    ray_address: Annotated[str | None, typer.Option("--ray-address", envvar="ORCHESTRA_RAY_ADDRESS", help="ray: 'local' (a private Ray), 'auto' "
                                                    "(the cluster on this machine) or 'ray://host:port'.")] = None,
    cors_origins: Annotated[str | None, typer.Option("--cors-origins", envvar="ORCHESTRA_CORS_ORIGINS", help="Comma-separated browser "
                                                     "origins allowed to call the API (CORS), or '*'.")] = None,
    allow_code: Annotated[list[str] | None, typer.Option("--allow-code", envvar="ORCHESTRA_ALLOW_CODE", metavar="PREFIX", help="A module prefix whose "
                          "Python (steps, tools, output models) pipelines sent inline to POST /v1/runs may name, e.g. "
                          "mycompany.checks; repeat it or separate with commas. Unset: none (docs/serving.md#security).")] = None,
    engine_kind: Annotated[str, typer.Option("--engine", envvar="ORCHESTRA_ENGINE", help="orchestra (its own decoding) or "
                                        "vllm (one vLLM engine per member, sharing the family cache; docs/vllm.md).")] = "orchestra",
    vllm_member: Annotated[list[str] | None, typer.Option("--vllm-member", envvar="ORCHESTRA_VLLM_MEMBER", metavar="MEMBER", help="--engine vllm: serve "
                           "only this member (name or role); repeat it. Unset: every member.")] = None,
    vllm_max_model_len: Annotated[int | None, typer.Option("--vllm-max-model-len", envvar="ORCHESTRA_VLLM_MAX_MODEL_LEN", min=16, help="--engine vllm: vLLM's "
                                  "--max-model-len for every engine.")] = None,
    adapter: Annotated[list[str] | None, typer.Option("--adapter", envvar="ORCHESTRA_ADAPTER", metavar="NAME=ADAPTER", help="Serve a peft "
                       "LoRA adapter (a folder or Hub id) over the source as model NAME, a member of its own; repeat it.")] = None,
    quantized: Annotated[list[str] | None, typer.Option("--quantized", envvar="ORCHESTRA_QUANTIZED", metavar="NAME=BASE:SCHEME", help="Serve "
                         "a torchao-quantized view of member BASE as model NAME (e.g. root-int8=root:int8); repeat it.")] = None,
    vllm_adapter: Annotated[list[str] | None, typer.Option("--vllm-adapter", envvar="ORCHESTRA_VLLM_ADAPTER", metavar="NAME=FOLDER", help="--engine vllm: "
                            "a peft LoRA adapter served by the root's engine as model NAME, sharing its documents; repeat it.")] = None,
    vllm_arg: Annotated[list[str] | None, typer.Option("--vllm-arg", envvar="ORCHESTRA_VLLM_ARG", metavar="ARG", help="--engine vllm: one more argument "
                        "for every vLLM server (e.g. --vllm-arg=--enforce-eager); repeat it.")] = None,
    config_file: Annotated[Path | None, typer.Option("--config", envvar="ORCHESTRA_CONFIG", help="A YAML or TOML file of these options "
                                                "(flags and ORCHESTRA_* variables win over it).")] = None,
) -> None:
    """Serve the family over the OpenAI chat-completions API; a prompt cached on one member serves them all."""
    if config_file is not None:
        from orchestra.commands._config_file import file_settings

        assert ctx.command.callback is not None
        ctx.invoke(ctx.command.callback, **{**ctx.params, **file_settings(ctx, config_file), "config_file": None})
        return
    if engine_kind not in ("orchestra", "vllm"):
        from orchestra.errors import OrchestraError

        raise OrchestraError(f"--engine {engine_kind!r}: use orchestra or vllm")
    if models:
        from orchestra.family.init import home_for_models

        home = home_for_models(models, under=home)
    if engine_kind == "vllm":
        from orchestra.commands._serve_vllm import serve_vllm

        _configure_logging(log_format)
        serve_vllm(home=home, host=host, port=port, dtype=dtype, api_key_env=api_key_env, members=vllm_member,
                   max_model_len=vllm_max_model_len, vllm_args=list(vllm_arg or []), graceful_s=graceful_s,
                   adapters=_pairs("--vllm-adapter", vllm_adapter))
        return
    import signal

    import structlog
    import uvicorn
    from pydantic import ValidationError

    from orchestra.errors import OrchestraError
    from orchestra.serve import ServeConfig, ServeEngine, create_app, tune_allocator

    if kv_store is not None and str(kv_store).lower() == "off":  # ORCHESTRA_KV_STORE=off, as for `orchestra run`
        kv_store = None
    _configure_logging(log_format)
    from orchestra.observability.tracing import configure_from_env

    configure_from_env()  # OTEL_EXPORTER_OTLP_ENDPOINT: spans of pipeline runs (POST /v1/runs) go there
    tune_allocator()  # before the models load: K/V memory freed under load goes back to the OS
    try:
        config = ServeConfig(home=home, device=device, dtype=dtype, source=source, api_key_env=api_key_env,
                             cache_mb=cache_mb, runtime_reserve_mb=runtime_reserve_mb, max_concurrent=max_concurrent, max_queue=max_queue,
                             max_body_bytes=int(max_body_mb * (1 << 20)), request_timeout_s=request_timeout,
                             max_tokens_limit=max_tokens_limit, default_max_tokens=default_max_tokens,
                             batch_decode=batch, max_batch=max_batch, inline_tail_tokens=inline_tail,
                             on_missing_mapping=on_missing_mapping, kv_store=kv_store, kv_store_mb=kv_store_mb,
                             pipelines_dir=pipelines, max_runs=max_runs,
                             cors_origins=[o.strip() for o in (cors_origins or "").split(",") if o.strip()],
                             allow_code=[p.strip() for item in allow_code or [] for p in str(item).split(",") if p.strip()],
                             executor=_executor_spec(executor, ray_address), repair=_ladder(repair_ladder),
                             adapters=_pairs("--adapter", adapter), quantized=_pairs("--quantized", quantized))
        config.api_key()  # a missing key is a start-up mistake, said before anything loads
        # what the flags, ORCHESTRA_* variables and --config file came to (the key's variable name, never the key)
        structlog.get_logger("orchestra.serve").info("settings", **config.model_dump(mode="json"))
        engine = ServeEngine(config)  # a missing family is refused here, not in the first request
        app_ = create_app(engine=engine)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise OrchestraError(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg'].removeprefix('Value error, ')}") from exc
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to whatever handler was there
    # before it: with Python's defaults that kills the process (-15) or raises KeyboardInterrupt after the clean
    # shutdown. Having shut down as asked is a success, so the signals are only noted and the command exits 0.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, frame: received.append(sig))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(app_, host=host, port=port, log_config=None, access_log=False,
                    # uvicorn annotates an int but hands it to asyncio.timeout, which takes fractions too
                    timeout_graceful_shutdown=graceful_s)  # type: ignore[arg-type]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.close()
    if received:
        structlog.get_logger("orchestra.serve").info("shutdown", signal=signal.Signals(received[0]).name)


def _ladder(text: str | None) -> dict[str, object] | None:
    """`--repair-ladder 0.02,0.05` as a RepairPolicy's fields (validated with the config: a bad one is exit 2)."""
    if text is None:
        return None
    try:
        budgets = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        from orchestra.errors import OrchestraError

        raise OrchestraError(f"--repair-ladder {text!r} is not a comma-separated list of numbers: give budgets "
                             "such as 0.02,0.05,0.1") from None
    return {"budget": 0.0, "ladder": budgets}


def _executor_spec(executor: str, address: str | None) -> dict:
    """`--executor` (a kind, or a mapping in JSON/YAML) with `--ray-address` laid over it."""
    import yaml

    from orchestra.errors import OrchestraError

    text = executor.strip()
    spec = yaml.safe_load(text) if text.startswith("{") else {"kind": text}
    if not isinstance(spec, dict):
        raise OrchestraError(f"--executor: expected local, ray or a mapping, not {executor!r}")
    if spec.get("kind") == "vllm":  # the vllm executor is for pipelines; the server has an engine option for it
        raise OrchestraError("--executor vllm: to serve on vLLM use --engine vllm (one vLLM engine per member)")
    if address is not None:
        if spec.get("kind", "local") != "ray":
            raise OrchestraError("--ray-address needs --executor ray")
        spec["address"] = address
    return spec


def _configure_logging(fmt: str) -> None:
    import logging

    import structlog

    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer()
    structlog.configure(processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
                                    structlog.processors.format_exc_info, renderer])
    logging.basicConfig(level=logging.INFO, format="%(message)s")


def _pairs(flag: str, items: list[str] | None) -> dict[str, str]:
    """``NAME=VALUE`` options as a mapping; a malformed one is a user's mistake naming the form."""
    from orchestra.errors import OrchestraError

    found: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise OrchestraError(f"{flag} {item!r}: write NAME=VALUE (see orchestra serve --help)")
        found[name] = value
    return found
