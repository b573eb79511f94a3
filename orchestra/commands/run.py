"""`orchestra run` and `orchestra graph`: run a pipeline file over a document, or draw it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from orchestra.commands._output import console

if TYPE_CHECKING:
    from orchestra.observability.metrics import PipelineMetrics
    from orchestra.serve._ui import RunLog, RunView

app = typer.Typer()

HomeOpt = Annotated[
    Path | None, typer.Option("--home", help="Family home (default: $ORCHESTRA_HOME or ~/.cache/orchestra).")
]


@contextlib.contextmanager
def pipeline_errors() -> Iterator[None]:
    """Print a pipeline mistake as ``error: Type: message`` on one line per problem, then exit 2.

    The CLI's group does the same for every command, but through a console that wraps at its width;
    a pipeline error names the file, the agent and the field, and is more useful unbroken (grep-able,
    one line per problem).
    """
    from orchestra.commands._output import cli_state
    from orchestra.errors import PipelineError

    try:
        yield
    except PipelineError as exc:
        if cli_state["debug"]:
            raise
        typer.echo(f"error: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(2) from exc


def _gates(a) -> str:
    gate = "; ".join(("pass " if g["passed"] else "FAIL ") + g["gate"] for g in a.gate) or "-"
    return gate + (" -> re-prefill" if a.fallback_reason else "")


def report_table(report):
    """One row per agent: member, status, cache path, gates, first-token time, tokens and prefill seconds."""
    from rich.table import Table

    table = Table(title=f"run {report.run_id}: {report.pipeline} ({report.document_tokens:,} document tokens)")
    numeric = {"TTFT s", "tokens", "prefill s spent", "prefill s saved"}
    for col in ("agent", "member", "status", "cache", "gates", "TTFT s", "tokens", "prefill s spent", "prefill s saved"):
        table.add_column(col, justify="right" if col in numeric else "left")
    for a in report.agents:
        status = a.status if a.status == "succeeded" else f"[red]{a.status}[/]" + (
            f" {a.error_type}" if a.status == "failed" else "")
        table.add_row(
            a.name, a.model, status, a.cache_path or "-", _gates(a), f"{a.ttft_s:.2f}" if a.ttft_s is not None else "-",
            str(a.tokens), f"{a.prefill_s_spent:.2f}", f"{a.prefill_s_saved:.2f}",
        )
    return table


def _answer(a) -> str:
    import json

    if a.parsed is not None:  # JSON agents: the validated object, indented, rather than the raw reply
        return json.dumps(a.parsed, indent=2, ensure_ascii=False)
    return (a.output or "").strip()


def print_report(report) -> None:
    """Each agent's answer, then one table of how every agent got its cache and what that saved."""
    for a in report.agents:
        console.rule(f"[bold]{a.name}[/] on {a.model} ({a.status})")
        answer = _answer(a)
        if answer:
            console.print(answer, highlight=False, markup=False)
        if a.status != "succeeded":
            why = a.error or a.skip_reason or getattr(a, "degenerate_reason", None) or ""
            if why:
                console.print(f"[red]{a.status}:[/] {why}", highlight=False)
    console.print(report_table(report))
    console.print(
        f"prefill seconds spent {report.prefill_s_spent:.2f}, saved {report.prefill_s_saved:.2f}; cache hit rate "
        f"{report.store_hit_rate:.0%}; run {report.seconds:.1f} s", highlight=False,
    )
    if report.executor != "local":
        where = ", ".join(f"{a.name} on {a.actor} @ {a.node}" for a in report.agents if a.actor)
        console.print(f"executor: {report.executor}; {where}; K/V moved between processes "
                      f"{report.kv_bytes_moved / 2**20:.1f} MiB ({report.kv_bytes_moved_across_nodes / 2**20:.1f} MiB "
                      f"across nodes), results to the driver {report.result_bytes_to_driver / 2**20:.1f} MiB", highlight=False)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)


AGENTS_FAILED_EXIT = 3
"""Exit code of `orchestra run` (and `demo`) when the run finished but an agent failed or was skipped."""


@dataclass(frozen=True)
class ViewOptions:
    """`orchestra run --ui`: serve the run's live web view on 127.0.0.1 (docs/web-view.md)."""

    port: int = 0
    wait: bool = False
    """Keep serving after the run finished, until Ctrl-C (else the command exits when the run does)."""


def view_options(ui: bool, ui_wait: bool, ui_port: int) -> ViewOptions | None:
    """The --ui options, checked before anything loads (a mistake is exit 2 naming the fix)."""
    if not ui:
        given = "--ui-wait" if ui_wait else "--ui-port" if ui_port else None
        if given is not None:
            from orchestra.errors import OrchestraError

            raise OrchestraError(f"{given} only applies to the web view: add --ui")
        return None
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        from agents.errors import MissingDependencyError
        from orchestra.errors import install_command

        raise MissingDependencyError(f"--ui serves the web view with {' and '.join(missing)}, which a core install "
                                     f"leaves out: {install_command('serve')}", name=missing[0])
    return ViewOptions(port=ui_port, wait=ui_wait)


def run_pipeline_file(pipeline_file: Path, document: Path, home: Path | None, report_out: Path | None,
                      stream: bool | str | None = False, encoding: str | None = None, executor: str | None = None,
                      ray_address: str | None = None, inputs: list[str] | None = None, kv_store: bool | None = None,
                      resume: str | None = None, view: ViewOptions | None = None, metrics_out: Path | None = None):
    """Validate the file (as deeply as `orchestra graph`) and the ``--input NAME=VALUE`` items, then run it
    through the Python API's `Pipeline`; with `metrics_out`, write the run's Prometheus metrics there."""
    from orchestra.builder import Pipeline
    from orchestra.pipelines.inputs import parse_input_args, resolve_inputs

    pipeline = Pipeline.from_file(pipeline_file, home=home).with_executor(executor, address=ray_address)
    pipeline.with_kv_store(kv_store)
    from orchestra.errors import FamilyHomeError
    from orchestra.paths import resolve_home

    try:
        pipeline.with_checkpointer(resolve_home(home) / "runs.sqlite")  # every run can be resumed
    except FamilyHomeError as exc:  # a read-only home still runs; only --resume needs the record
        if resume is not None:
            raise
        if stream != "jsonl":
            console.print(f"[dim]this run cannot be resumed: {exc}[/dim]")
    values = resolve_inputs(pipeline.spec.inputs, parse_input_args(inputs or []))  # before any model loads
    metrics = None
    if metrics_out is not None:  # a missing prometheus-client is said now, not after the run
        from orchestra.observability.metrics import PipelineMetrics

        metrics = (PipelineMetrics.own(), metrics_out)
    try:  # a ray executor's actors and placement group go away with the run, Ctrl-C included
        return _run_pipeline(pipeline, document, report_out, stream, encoding, values, resume, view, metrics)
    finally:
        pipeline.close()


def _open_view(stack: contextlib.ExitStack, pipeline, run_id: str, options: ViewOptions | None,
               jsonl: bool) -> tuple[RunView, RunLog] | None:
    """With --ui: the run's web view, served until `stack` closes (its URL printed); None without --ui."""
    if options is None:
        return None
    from orchestra.serve._ui import open_run_view

    server, log = stack.enter_context(open_run_view(pipeline.spec, pipeline.orchestra().cache, run_id,
                                                    port=options.port))
    hint = "" if options.wait else " (it closes when the run ends; --ui-wait keeps it open)"
    typer.echo(f"web view: {server.url}{hint}", err=jsonl)  # under --jsonl stdout stays the events alone
    return server, log


def _run_pipeline(pipeline, document: Path, report_out: Path | None, stream: bool | str | None, encoding: str | None,
                  inputs: dict[str, str] | None = None, resume: str | None = None, view: ViewOptions | None = None,
                  metrics: tuple[PipelineMetrics, Path] | None = None):
    import uuid

    from agents.bridge import run_blocking
    from orchestra.commands._live import RunDisplay, quiet_library_output
    from orchestra.documents.formats import load_document

    text = load_document(document, encoding=encoding).text
    jsonl = stream == "jsonl"  # stdout is the events, one JSON object per line, and nothing else
    with contextlib.ExitStack() as stack:  # the web view (--ui), closed however the command ends
        with quiet_library_output(console):
            pipeline.orchestra()  # family, models and devices are checked here, before the event loop starts
            run_id = resume or uuid.uuid4().hex[:12]
            if resume is None and not jsonl:
                console.print(f"[dim]run {run_id}: if it stops, `--resume {run_id}` continues it[/dim]")
            rows = [(a.name, a.model) for a in pipeline.agents] + [(s.name, "step") for s in pipeline.spec.steps]
            display = RunDisplay(console, rows, lines=bool(stream) and not jsonl)
            live = _open_view(stack, pipeline, run_id, view, jsonl)
            counted = metrics[0].sink(pipeline.name) if metrics is not None else None

            async def main():
                finished = None
                with contextlib.nullcontext() if jsonl else display:
                    async for event in pipeline.stream(text, inputs=inputs, run_id=run_id, resume=resume is not None):
                        if jsonl:
                            typer.echo(event.model_dump_json())
                        else:
                            display(event)
                        if live is not None:
                            live[1].append(event)
                        if counted is not None:
                            counted(event)
                        if event.kind == "run_finished":
                            finished = event.report  # this run's own report, whatever else runs in the process
                return finished

            report = run_blocking(main)
            if live is not None:
                live[1].finish_with(report)
        if not jsonl:
            print_report(report)
        if metrics is not None:
            metrics[0].write_textfile(metrics[1])
        if report_out is not None:
            from orchestra.documents.files import write_output

            write_output(report_out, report.model_dump_json(indent=2))
            if not jsonl:
                console.print(f"report written to {report_out}")
        if live is not None and view is not None and view.wait:
            typer.echo(f"the run is over; the web view stays at {live[0].url} until Ctrl-C", err=jsonl)
            live[0].serve_until_interrupted()
    return report


def exit_on_failed_agents(report) -> None:
    """Say which agents failed or were skipped, and exit with `AGENTS_FAILED_EXIT`; nothing if all succeeded."""
    bad = [a for a in report.agents if a.status != "succeeded"]
    if not bad:
        return
    parts = [f"{a.name} failed ({a.error_type}: {a.error})" if a.status == "failed" else
             f"{a.name} {a.status}" + (f" ({a.skip_reason})" if a.skip_reason else "") for a in bad]
    typer.echo(f"error: {len(parts)} of {len(report.agents)} agents did not succeed: " + "; ".join(parts), err=True)
    raise typer.Exit(AGENTS_FAILED_EXIT)


@app.command("run")
def run(
    pipeline: Annotated[Path, typer.Argument(help="Pipeline file (.yaml/.yml/.json).")],
    document: Annotated[Path, typer.Option("--document", help="The long document: a text, Markdown, PDF, HTML or "
                                           "DOCX file (PDF/HTML/DOCX need the `documents` extra).")],
    report: Annotated[Path | None, typer.Option("--report", help="Write the run report JSON here.")] = None,
    home: HomeOpt = None,
    events: Annotated[bool, typer.Option("--events", help="Print events (gates, fallbacks, caches) as they happen.")] = False,
    jsonl: Annotated[bool, typer.Option("--jsonl", help="Print every event (tokens included) as one JSON object per "
                                        "line on stdout, and nothing else; the last, run_finished, carries the "
                                        "report.")] = False,
    encoding: Annotated[
        str | None, typer.Option("--encoding", help="The document's text encoding (default: UTF-8, or as its BOM says).")
    ] = None,
    executor: Annotated[
        str | None, typer.Option("--executor", help="Where model work runs: local, ray or vllm (default: the pipeline's).")
    ] = None,
    ray_address: Annotated[
        str | None, typer.Option("--ray-address", help="ray: local, auto, ray://host:port or host:port (docs/scale-out.md).")
    ] = None,
    inputs: Annotated[
        list[str] | None, typer.Option("--input", help="NAME=VALUE: a value of one of the pipeline's `inputs` "
                                       "(repeat for each); templates read it as {NAME}.")
    ] = None,
    resume: Annotated[
        str | None, typer.Option("--resume", help="RUN_ID: continue a run that stopped (its id is printed when it "
                                 "starts): agents that finished keep their results, the rest run.")
    ] = None,
    kv_store: Annotated[
        bool | None, typer.Option("--kv-store/--no-kv-store", help="Read and keep document caches on disk "
                                  "(<home>/kv) across runs (default: the pipeline's kv_store, on).")
    ] = None,
    ui: Annotated[bool, typer.Option("--ui", help="Serve a live web view of the run on 127.0.0.1 (its URL is printed): "
                                     "the DAG, each agent's state, cache path, gates and tokens. Needs the `serve` "
                                     "extra.")] = False,
    ui_wait: Annotated[bool, typer.Option("--ui-wait", help="With --ui: keep serving the view after the run finished, "
                                          "until Ctrl-C (the exit code is still the run's).")] = False,
    ui_port: Annotated[int, typer.Option("--ui-port", min=0, max=65535, help="With --ui: the view's port (default: a "
                                         "free one).")] = 0,
    metrics_out: Annotated[Path | None, typer.Option("--metrics", help="Write the run's Prometheus metrics here "
                                                     "(text format, for node_exporter's textfile collector; the "
                                                     "`serve` extra).")] = None,
) -> None:
    """Run a pipeline over a document: prefill once, map to every member, run the agents, print the report.

    Exit codes: 0 every agent succeeded; 2 a mistake in the command, pipeline, document or family (one
    line says what to fix); 3 the run finished but an agent failed or was skipped (named on stderr);
    130 interrupted.
    """
    with pipeline_errors():
        from orchestra.observability.tracing import configure_from_env

        view = view_options(ui, ui_wait, ui_port)  # before anything loads
        configure_from_env()  # OTEL_EXPORTER_OTLP_ENDPOINT: the run's spans go there
        result = run_pipeline_file(pipeline, document, home, report, stream="jsonl" if jsonl else events,
                                   encoding=encoding,
                                   executor=executor, ray_address=ray_address, inputs=inputs, kv_store=kv_store,
                                   resume=resume, view=view, metrics_out=metrics_out)
    exit_on_failed_agents(result)


@app.command("graph")
def graph(
    pipeline: Annotated[Path, typer.Argument(help="Pipeline file (.yaml/.yml/.json).")],
) -> None:
    """Print the pipeline's agent DAG as a mermaid flowchart.

    It validates the file exactly as `orchestra run` does before loading anything (every agent's spec is
    built: built-in names and arguments, templates, generation bounds; upstreams, cycles), and loads no model.
    """
    from orchestra.pipelines.spec import load_pipeline, pipeline_mermaid

    with pipeline_errors():
        text = pipeline_mermaid(load_pipeline(pipeline))
    typer.echo(text, nl=False)


def _demo_paths(long: bool = False) -> tuple[Path, Path]:
    root = Path(__file__).resolve().parents[2] / "examples" / "long_document_analysis"
    if long:  # four licences, 2.3x the bundled model's context, chunked (long.yaml says how)
        return root / "long.yaml", root / "licences.md"
    return root / "pipeline.yaml", root / "document.txt"


def demo_command(home: Path | None, report_out: Path | None, long: bool = False) -> None:
    from agents.constrained import require_grammar
    from orchestra.commands._output import family_table
    from orchestra.errors import PipelineFileError
    from orchestra.family import build_family

    require_grammar()  # the demo's key_facts agent is a JSON agent: refuse now, not after a 25-minute build
    manifest = build_family(home, log=console.print)
    console.print(family_table(manifest))
    pipeline_file, document = _demo_paths(long)
    if not pipeline_file.is_file():
        raise PipelineFileError(
            f"the demo pipeline {pipeline_file} is missing: run `orchestra demo` from a source checkout "
            "(pip install -e .), or `orchestra run PIPELINE --document FILE` with your own files"
        )
    exit_on_failed_agents(run_pipeline_file(pipeline_file, document, Path(manifest.home), report_out, stream=True))
