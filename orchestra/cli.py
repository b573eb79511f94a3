"""The `orchestra` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from orchestra.commands import cache as cache_cmd
from orchestra.commands import family as family_cmd
from orchestra.commands._output import cli_state as _state
from orchestra.commands._output import err_console, print_error

DEBUG_ENV = "ORCHESTRA_DEBUG"


class _Group(TyperGroup):
    """The CLI's one error path: a typed error (or the environment refusing a file operation) is one
    ``error:`` line and exit code 2; Ctrl-C is exit 130; ``--debug`` (or ``$ORCHESTRA_DEBUG=1``) shows
    the traceback instead. Tracebacks otherwise only for bugs."""

    def invoke(self, ctx):
        import os

        from agents.errors import MissingDependencyError
        from mappings.errors import MappingError
        from orchestra.errors import OrchestraError

        _state["debug"] = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        try:
            return super().invoke(ctx)
        except (OrchestraError, MappingError, MissingDependencyError) as exc:
            if _state["debug"]:
                raise
            print_error(str(exc), exc)
            raise typer.Exit(2) from exc
        except OSError as exc:  # a file the user named cannot be read or written (permissions, a full disk)
            if _state["debug"]:
                raise
            print_error(f"{exc} (--debug shows the traceback)", exc)
            raise typer.Exit(2) from exc
        except KeyboardInterrupt as exc:
            if _state["debug"]:
                raise
            err_console.print("[bold red]interrupted[/]: nothing half-written was kept", highlight=False)
            raise typer.Exit(130) from exc


app = typer.Typer(
    cls=_Group,
    help="Run multi-agent pipelines over one long document on a family of LLMs, prefilling it once.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(family_cmd.app, name="family")
app.add_typer(cache_cmd.app, name="cache")


def _print_version(value: bool) -> None:
    """``--version``: ``orchestra <version>``, then exit 0 before any command runs."""
    if value:
        from orchestra import __version__

        typer.echo(f"orchestra {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option("--debug", help="Show the full traceback of an error (also $ORCHESTRA_DEBUG=1).")] = False,
    version: Annotated[bool, typer.Option("--version", "-V", callback=_print_version, is_eager=True,
                                          help="Print orchestra's version and exit.")] = False,
) -> None:
    """Run multi-agent pipelines over one long document on a family of LLMs, prefilling it once."""
    if debug:
        _state["debug"] = True


def _register_commands() -> None:
    from orchestra.bench import _cli as bench
    from orchestra.commands import mapping, run, serve

    for sub in (mapping.app, run.app, bench.app, serve.app):
        for command in sub.registered_commands:
            app.registered_commands.append(command)


_register_commands()


@app.command("demo")
def demo(
    home: Annotated[Path | None, typer.Option("--home", help="Family home (default: $ORCHESTRA_HOME or ~/.cache/orchestra).")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Also write the run report JSON here.")] = None,
    long: Annotated[bool, typer.Option("--long", help="A document 2.3x the model's context (four licences), cut into "
                                       "chunks each prefilled once; agents map over the chunks, a report reduces.")]
    = False,
) -> None:
    """The main job: build or reuse the bundled family, then run the long-document analysis pipeline."""
    from orchestra.commands.run import demo_command

    demo_command(home, report, long)


def main() -> None:
    """The console script: the command, then a process exit that skips native libraries' teardown.

    Once a command has finished (its files written, its server drained, its caches flushed), the
    interpreter's own finalization still runs the C++ static destructors of the libraries it loaded
    (torch, the grammar library, tokenizers). Now and then one of them aborts there ("terminate called
    without an active exception", SIGABRT), turning a clean exit into a crash an operator's supervisor
    reports. So the exit is taken here: other threads joined, atexit handlers run (logging, OpenTelemetry,
    Ray), streams flushed, then ``os._exit`` with the command's own code.
    """
    try:
        app()
        code: int | str | None = 0
    except SystemExit as exc:
        code = exc.code
    _exit_after_finalizers(code)


def _exit_after_finalizers(code: int | str | None) -> None:
    import atexit
    import os
    import sys
    import threading

    if isinstance(code, str):  # sys.exit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said on it
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
