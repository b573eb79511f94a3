"""Shared terminal output helpers for the CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from orchestra.family import FamilyManifest

console = Console()
err_console = Console(stderr=True)


def family_table(manifest: FamilyManifest) -> Table:
    table = Table(title=f"{manifest.family} family at {manifest.home}")
    for col in ("member", "role", "parent", "layers", "params", "fingerprint", "KL vs root", "top-1 vs root"):
        table.add_column(col, justify="right" if col in {"layers", "params", "KL vs root", "top-1 vs root"} else "left")
    for r in manifest.members.values():
        d = r.divergence
        table.add_row(
            r.name, r.role, r.parent or "-", str(r.num_layers), f"{r.num_parameters / 1e6:.1f}M",
            r.fingerprint["combined"][:12], f"{d.kl:.4f}" if d else "-", f"{d.top1:.3f}" if d else "-",
        )
    return table
