"""`orchestra cache ...`: what the disk tier holds, and removing it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from orchestra.commands._output import console

if TYPE_CHECKING:
    from orchestra.familycache import KVStore, StoredEntry

app = typer.Typer(help="The disk tier of document caches: list, remove, prune.", no_args_is_help=True)

HomeOpt = Annotated[
    Path | None, typer.Option("--home", help="Family home (default: $ORCHESTRA_HOME or ~/.cache/orchestra).")
]
StoreOpt = Annotated[
    Path | None, typer.Option("--store", help="The store folder (default: <home>/kv, where runs keep their caches).")
]


def _open(home: Path | None, store: Path | None) -> KVStore:
    from orchestra.familycache import KVStore
    from orchestra.paths import resolve_home

    directory = store if store is not None else resolve_home(home, writable=False) / "kv"
    return KVStore(directory)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


@app.command("ls")
def ls(home: HomeOpt = None, store: StoreOpt = None,
       as_json: Annotated[bool, typer.Option("--json", help="One JSON object per entry.")] = False) -> None:
    """List the stored caches, least recently used first: key, kind, member, tokens, size, last use."""
    import json

    from rich.table import Table

    kv = _open(home, store)
    entries = kv.entries()
    if as_json:
        for e in entries:
            typer.echo(json.dumps({"key": e.key, "kind": e.namespace.kind, "member": e.member, "tokens": len(e.tokens),
                                   "bytes": e.nbytes, "last_used": e.mtime, "model": e.namespace.member_fingerprint,
                                   "mapping": e.namespace.mapping_id}))
        return
    table = Table(title=f"{kv.directory}: {len(entries)} caches, {sum(e.nbytes for e in entries) / 2**20:.1f} MiB")
    for column in ("key", "kind", "member", "tokens", "MiB", "last used"):
        table.add_column(column)
    now = time.time()
    for e in entries:
        table.add_row(e.key, e.namespace.kind, e.member, str(len(e.tokens)), f"{e.nbytes / 2**20:.1f}",
                      _age(now - e.mtime) + " ago")
    console.print(table)


@app.command("rm")
def rm(keys: Annotated[list[str] | None, typer.Argument(help="Keys (or key prefixes) from `orchestra cache ls`.")] = None,
       home: HomeOpt = None, store: StoreOpt = None,
       everything: Annotated[bool, typer.Option("--all", help="Remove every stored cache.")] = False) -> None:
    """Remove stored caches by key, or all of them."""
    from orchestra.errors import OrchestraError

    kv = _open(home, store)
    entries = kv.entries()
    if everything:
        chosen = entries
    elif keys:
        chosen = []
        for key in keys:
            matched = [e for e in entries if e.key.startswith(key)]
            if not matched:
                raise OrchestraError(f"no stored cache has a key starting {key!r}: see `orchestra cache ls`")
            chosen += matched
    else:
        raise OrchestraError("name the caches to remove (keys from `orchestra cache ls`) or pass --all")
    for e in chosen:
        kv.remove(e)
    console.print(f"removed {len(chosen)} caches ({sum(e.nbytes for e in chosen) / 2**20:.1f} MiB)")


@app.command("prune")
def prune(home: HomeOpt = None, store: StoreOpt = None,
          max_mb: Annotated[int | None, typer.Option("--max-mb", min=0, help="Keep at most this many MiB (least "
                                                     "recently used go first).")] = None,
          stale: Annotated[bool, typer.Option("--stale/--no-stale", help="Remove mapped caches whose mapping is no "
                                              "longer in the home's mapping store.")] = True) -> None:
    """Remove mapped caches of mappings that are gone, then the least recently used beyond --max-mb."""
    kv = _open(home, store)
    keep = None
    if stale:
        current = _mapping_ids(kv.directory.parent / "mappings")

        def keep(e: StoredEntry) -> bool:
            return e.namespace.kind == "exact" or e.namespace.mapping_id in current

    removed = kv.prune(None if max_mb is None else max_mb << 20, keep=keep)
    console.print(f"removed {len(removed)} caches ({sum(e.nbytes for e in removed) / 2**20:.1f} MiB); "
                  f"{len(kv.entries())} left ({kv.used_bytes / 2**20:.1f} MiB)")


def _mapping_ids(directory: Path) -> set[str]:
    """Content hashes of the mappings stored under `directory` (read from their manifests, no tensors)."""
    import json

    ids: set[str] = set()
    for manifest in directory.glob("*/manifest.json"):
        try:
            ids.add(str(json.loads(manifest.read_text())["tensors"]["sha256"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return ids
