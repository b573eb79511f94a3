"""Shared terminal output helpers for the CLI."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from orchestra.family import FamilyManifest

# `orchestra --debug` (or $ORCHESTRA_DEBUG=1): errors show their traceback instead of one line.
cli_state = {"debug": False}

# Pipes and CI logs get a wide console, so tables are not squeezed into 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def print_error(message: str, exc: BaseException | None = None) -> None:
    """One ``error:`` line on stderr: ``Type: message`` for an exception, the message alone otherwise.

    The text is escaped: a message naming an extra (``orchestra-kv[build]``) or a list must not be
    read as rich markup and lose its brackets.
    """
    from rich.markup import escape

    text = f"{type(exc).__name__}: {message}" if exc is not None else message
    err_console.print(f"[bold red]error:[/] {escape(text)}", highlight=False, soft_wrap=True)


def family_table(manifest: FamilyManifest) -> Table:
    table = Table(title=f"{manifest.family} family at {manifest.home}")
    numeric = {"layers", "params", "weights", "KL vs root", "top-1 vs root"}
    for col in ("member", "role", "parent", "layers", "params", "weights", "fingerprint", "KL vs root",
                "top-1 vs root"):
        table.add_column(col, justify="right" if col in numeric else "left")
    for r in manifest.members.values():
        d = r.divergence
        table.add_row(
            r.name, r.role, r.parent or "-", str(r.num_layers), f"{r.num_parameters / 1e6:.1f}M",
            f"{r.bytes / 2**20:,.0f} MiB", r.fingerprint["combined"][:12], f"{d.kl:.4f}" if d else "-",
            f"{d.top1:.3f}" if d else "-",
        )
    return table
