"""`orchestra serve` settings from a file, the environment and flags, in that rising precedence; CORS for
browser origins; a server span per HTTP request."""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

from tests.waiting import HANG_GUARD_S


def test_flags_beat_the_environment_which_beats_the_config_file(tiny_family_home, server_factory, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("cache-mb: 77\nmax_queue: 9\nmax-concurrent: 3\n"
                      "cors-origins: 'https://app.example, https://other.example'\n")
    server = server_factory(tiny_family_home, "--config", str(config), "--max-concurrent", "2",
                            env={"ORCHESTRA_MAX_QUEUE": "5"})
    # the file: no flag, no variable (the cache's budget is --cache-mb less the runtime reserve, here a quarter)
    assert server.metric("orchestra_cache_budget_bytes") == (77 - 77 // 4) << 20
    # the queue (variable 5, file 9) and the slots (flag 2, file 3): flood it and count what waits before 429
    preflight = httpx.options(f"{server.base_url}/v1/chat/completions", timeout=HANG_GUARD_S, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": "https://evil.example"}, timeout=HANG_GUARD_S)
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    log = server.log.read_text()
    assert '"max_concurrent": 2' in log and '"max_queue": 5' in log, log[-2000:]


def test_a_config_file_mistake_is_one_line_and_exit_2(tmp_path):
    from orchestra.cli import app

    runner = CliRunner()
    for text, expected in (("nope: 1\n", "'nope' is not an option of `orchestra serve`"),
                           ("cache-mb: 0\n", "cache-mb:"), ("port: [1]\n", "port:"),
                           ("- a list\n", "must be a mapping"), (": :\n", "not valid YAML")):
        config = tmp_path / "serve.yaml"
        config.write_text(text)
        result = runner.invoke(app, ["serve", "--home", str(tmp_path / "nohome"), "--config", str(config)])
        assert result.exit_code == 2, (text, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], (text, result.output)
    result = runner.invoke(app, ["serve", "--config", str(tmp_path / "missing.toml")])
    assert result.exit_code == 2 and "no such file" in result.output


def test_a_server_refuses_the_answer_gate_it_cannot_apply():
    from pydantic import ValidationError

    from orchestra.serve._config import ServeConfig

    with pytest.raises(ValidationError, match="drop 'answer' from the server's gate"):
        ServeConfig(gate={"answer": {"min_f1": 0.5}})
    assert ServeConfig().gate.answer is None


def test_a_toml_config_file_is_read_too(tmp_path):
    from orchestra.cli import app

    config = tmp_path / "serve.toml"
    config.write_text('cache_mb = 64\nhome = "%s"\n' % (tmp_path / "nohome"))
    result = CliRunner().invoke(app, ["serve", "--config", str(config)])
    # the file's home reached the server: it says that family is missing, naming the folder the file gave
    assert result.exit_code == 2 and str(tmp_path / "nohome") in result.output, result.output


def test_every_http_request_is_a_server_span(tiny_serve_family):
    pytest.importorskip("opentelemetry.instrumentation.fastapi")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from orchestra.serve import create_app
    from tests.orchestra.serve.conftest import tiny_engine

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(engine=tiny_engine(tiny_serve_family), tracer_provider=provider)
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        assert client.get("/v1/models", headers={"x-request-id": "abc"}).status_code == 200
        assert client.get("/metrics").status_code == 200
    servers = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert [s.name for s in servers] == ["GET /v1/models"]
    assert servers[0].attributes["http.route"] == "/v1/models"


def test_every_serve_option_is_in_the_documented_table_with_its_environment_variable():
    import re
    from pathlib import Path

    import typer.main

    from orchestra.cli import app

    command = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    doc = (Path(__file__).parents[3] / "docs" / "serving.md").read_text()
    table = [line for line in doc.split("## Configure", 1)[1].split("## The API", 1)[0].splitlines()
             if line.startswith("| `--")]
    documented = {m.group(1) for line in table for m in re.finditer(r"`(--[a-z-]+)", line.split("|")[1])}
    for param in command.params:
        if param.param_type_name != "option":
            continue
        assert param.opts[0] in documented, f"{param.opts[0]} is missing from docs/serving.md's table"
        if param.name != "home":  # ORCHESTRA_HOME is the home's default everywhere, not a serve option's variable
            assert param.envvar == "ORCHESTRA_" + param.opts[0].lstrip("-").replace("-", "_").upper(), param.name


def test_the_grafana_dashboard_reads_only_series_the_server_exports(tiny_serve_family):
    """docs/grafana/orchestra-dashboard.json: every series its queries name is one `orchestra serve` registers
    (the vLLM-named ones included, so its first panels read a vLLM server as well)."""
    import json
    import re
    from pathlib import Path

    from fastapi.testclient import TestClient

    from orchestra.serve import create_app
    from tests.orchestra.serve.conftest import tiny_engine

    dashboard = json.loads((Path(__file__).parents[3] / "docs" / "grafana" / "orchestra-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(dashboard["panels"]) >= 10 and all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
    # the only member label is vLLM's `model_name`, on the server's series and the pipeline series alike
    functions = {"histogram_quantile", "sum", "max", "rate", "by", "le", "model_name", "path", "gate", "kind",
                 "pipeline", "status", "reason", "step"}
    used = {m for e in exprs for m in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", re.sub(r'"[^"]*"|\[[^]]*\]', "", e))
            if m not in functions and not m[0].isdigit()}
    engine = tiny_engine(tiny_serve_family)
    assert engine.runs is not None  # the pipeline series register with the run manager
    with TestClient(create_app(engine=engine)) as client:
        text = client.get("/metrics").text
    exported = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    for name in sorted(used):
        base = re.sub(r"_(bucket|total|count|sum)$", "", name)
        assert name in exported or base in exported or f"{base}_total" in exported, f"{name} is not exported"
    assert any(n.startswith("vllm:") for n in used) and any(n.startswith("orchestra_pipeline_") for n in used)
    assert {"vllm:inter_token_latency_seconds_bucket", "vllm:kv_cache_usage_perc"} <= used
    assert not any("{{model}}" in t.get("legendFormat", "") for p in dashboard["panels"] for t in p["targets"])
