"""The `orchestra` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from orchestra.commands import family as family_cmd
from orchestra.commands._output import err_console


class _Group(TyperGroup):
    """Turns the project's typed errors into one readable line and exit code 2, tracebacks only for bugs."""

    def invoke(self, ctx):
        from mappings.errors import MappingError
        from orchestra.errors import OrchestraError

        try:
            return super().invoke(ctx)
        except (OrchestraError, MappingError) as exc:
            err_console.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from exc


app = typer.Typer(
    cls=_Group,
    help="Run multi-agent pipelines over one long document on a family of LLMs, prefilling it once.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(family_cmd.app, name="family")


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
) -> None:
    """The main job: build or reuse the bundled family, then run the long-document analysis pipeline."""
    from orchestra.commands.run import demo_command

    demo_command(home, report)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
