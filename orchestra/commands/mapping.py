"""`orchestra calibrate`, `calibrate-repair` and `evaluate`: fit a KV map for a pair, and measure it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

if TYPE_CHECKING:
    from mappings.models import ModelHandle

app = typer.Typer(help="Fit and evaluate cross-model KV maps.", no_args_is_help=True)

ManifestSourceOpt = Annotated[
    str | None, typer.Option("--source", help="Source model folder or Hub id org/name[@revision] (default: the "
                             "folder in the manifest).")
]
ManifestTargetOpt = Annotated[
    str | None, typer.Option("--target", help="Target model folder or Hub id org/name[@revision] (default: the "
                             "folder in the manifest).")
]


def _fail(exc: Exception) -> typer.Exit:
    from orchestra.commands._output import cli_state, print_error

    if cli_state["debug"]:
        raise exc

    print_error(str(exc), exc)
    return typer.Exit(2)


EncodingOpt = Annotated[
    str | None, typer.Option("--encoding", help="Text encoding of the input files (default: UTF-8, or as a BOM says).")
]


def _read_text(path: Path, encoding: str | None = None, what: str = "corpus file") -> str:
    """A text file; binary or wrongly encoded files are an InputFileError (exit 2) saying which and what to do."""
    from orchestra.documents.files import read_text_file

    return read_text_file(path, encoding=encoding, what=what)


def _load(reference: str | Path, device: str = "cpu") -> ModelHandle:
    """A model named by folder or Hub id (`orchestra.models.modelref`), loaded with the fingerprint a pipeline gives it:
    a folder's weights hashed once and kept beside it, a Hub snapshot's read from the Hugging Face cache."""
    from transformers import AutoTokenizer

    from mappings.models import load_model
    from orchestra.models.modelref import ModelRef

    resolved = ModelRef.parse(reference).resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
    return load_model(resolved.path, tokenizer, device=device, fingerprint=resolved.fingerprint(tokenizer))


def _pair_refs(mapping: Path, source: str | None, target: str | None) -> tuple[str | Path, str | Path]:
    """The models given, else the folders the mapping's manifest names."""
    from mappings.store import read_manifest

    manifest = read_manifest(mapping)
    src = source or manifest.source.path
    tgt = target or manifest.target.path
    if src is None or tgt is None:
        raise ValueError("the mapping does not record its model folders: pass --source and --target")
    return src, tgt


def _write_json(path: Path, data: object) -> None:
    """Written to a temporary sibling, then renamed into place."""
    import json

    from orchestra.documents.files import write_output

    write_output(path, json.dumps(data, indent=2), what="served report")


@app.command("calibrate")
def calibrate_cmd(
    source: Annotated[str, typer.Option("--source", help="Model folder or Hub id org/name[@revision] whose KV "
                                        "cache is carried over.")],
    target: Annotated[str, typer.Option("--target", help="Model folder or Hub id org/name[@revision] that "
                                        "receives the mapped cache.")],
    corpus: Annotated[
        list[Path],
        typer.Option("--corpus", help="Calibration text file; repeat for several. With several, the last one is "
                     "held out to choose λ per layer (use text the target was not fine-tuned on)."),
    ],
    out: Annotated[Path, typer.Option("--out", help="Directory to write the mapping into.")],
    method: Annotated[
        str, typer.Option("--method", help="Mapping method: auto, anchored_kl, anchored_kl_full, ridge_kl, anchored, "
                          "perhead_rope, ridge, paper or lowrank.")
    ] = "auto",
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Calibration tokens to fit on.")] = 16384,
    window: Annotated[int, typer.Option("--window", min=8, help="Tokens per calibration window.")] = 512,
    stride: Annotated[
        int | None, typer.Option("--stride", min=1, help="Start-to-start distance of fitting windows (default: "
                                 "disjoint windows, overlapping by 1/2 or 3/4 only when the corpus is too small).")
    ] = None,
    device: Annotated[str, typer.Option("--device", help="Torch device for both models.")] = "cpu",
    no_stats: Annotated[
        bool, typer.Option("--no-stats", help="Do not store calibration statistics (evaluate cannot refit baselines).")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bars or pair card.")] = False,
    repair: Annotated[
        bool, typer.Option("--repair", help="Also fit residual-stream maps, so layer blocks can be repaired.")
    ] = False,
    repair_tokens: Annotated[
        int, typer.Option("--repair-tokens", min=1, help="Calibration tokens for the residual-stream maps.")
    ] = 4096,
    encoding: EncodingOpt = None,
) -> None:
    """Fit a closed-form KV map from SOURCE to TARGET on the corpus and save it to OUT.

    OUT is replaced only once the new mapping is complete: an interrupted or failed run leaves an existing
    mapping there intact.
    """
    from mappings.errors import MappingError
    from orchestra.commands._output import console

    try:
        from mappings.calibrate import CalibrationSettings, calibrate
        from mappings.store import check_out_dir

        check_out_dir(out)  # a file or a folder of other things is refused before the calibration, not after
        texts = [(p.name, _read_text(p, encoding)) for p in corpus]
        settings = CalibrationSettings(method=method, tokens=tokens, window=window, stride=stride, device=device)
        src, tgt = _load(source, device), _load(target, device)
        mapping = calibrate(src, tgt, texts, settings, progress=not quiet, log=None if quiet else console.print)
        if repair:
            from mappings.calibrate_repair import add_residual_maps

            add_residual_maps(mapping, src, tgt, texts, tokens=repair_tokens, window=window)
        path = mapping.save(out, with_stats=not no_stats)
    except (MappingError, ValueError, FileNotFoundError) as exc:
        raise _fail(exc) from exc
    held = mapping.manifest.heldout
    line = f"wrote {path} ({mapping.manifest.method.name}, held-out KL {held.get('kl', float('nan')):.4f}"
    if held.get("kl_identity") is not None:
        line += f", source KV unchanged {held['kl_identity']:.4f}"
    console.print(line + ")")


@app.command("calibrate-repair")
def calibrate_repair_cmd(
    mapping: Annotated[Path, typer.Option("--mapping", help="Mapping directory to add residual-stream maps to.")],
    corpus: Annotated[list[Path], typer.Option("--corpus", help="Calibration text file; repeat for several.")],
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Calibration tokens to fit on.")] = 4096,
    window: Annotated[int, typer.Option("--window", min=8, help="Tokens per calibration window.")] = 512,
    source: ManifestSourceOpt = None,
    target: ManifestTargetOpt = None,
    encoding: EncodingOpt = None,
) -> None:
    """Fit residual-stream maps for an existing mapping (layer repair) and save them beside it."""
    from mappings.errors import MappingError
    from orchestra.commands._output import console

    try:
        from mappings.calibrate_repair import add_residual_maps
        from mappings.store import load_mapping

        src, tgt = _pair_refs(mapping, source, target)
        loaded = load_mapping(mapping, with_stats=True)
        texts = [(p.name, _read_text(p, encoding)) for p in corpus]
        add_residual_maps(loaded, _load(src), _load(tgt), texts, tokens=tokens, window=window)
        loaded.save(mapping, with_stats=loaded.stats is not None)
    except (MappingError, ValueError, FileNotFoundError) as exc:
        raise _fail(exc) from exc
    info = loaded.manifest.repair
    assert info is not None  # add_residual_maps records what it fitted
    low = min(range(len(info.residual_cosine)), key=lambda i: info.residual_cosine[i])
    console.print(f"wrote residual maps to {mapping} ({len(info.residual_cosine)} layers, lowest held-out cosine "
                  f"{info.residual_cosine[low]:.4f} at layer {low}, {info.residual_seconds:.1f} s)")


@app.command("evaluate")
def evaluate_cmd(
    mapping: Annotated[Path, typer.Option("--mapping", help="Mapping directory written by `orchestra calibrate`.")],
    document: Annotated[Path, typer.Option("--document", help="Text file to evaluate on (not seen in calibration).")],
    prefix_tokens: Annotated[
        int, typer.Option("--prefix-tokens", min=1, help="Document tokens carried as a (mapped) cache.")
    ] = 1024,
    suffix_tokens: Annotated[
        int, typer.Option("--suffix-tokens", min=1, help="Following tokens fed as real input and scored.")
    ] = 32,
    windows: Annotated[
        int, typer.Option("--windows", min=1, help="Score this many consecutive prefix+suffix spans and average.")
    ] = 1,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the report as JSON here (layer plots as PNG next to it).")
    ] = None,
    tail_tokens: Annotated[
        int, typer.Option("--tail-tokens", min=0, help="Also score variants that recompute the last N prefix tokens.")
    ] = 64,
    sink_tokens: Annotated[
        int, typer.Option("--sink-tokens", min=0, help="Also score the map with its first N positions the target's "
                          "own (what a FamilyCache serves by default); 0: no such row.")
    ] = 4,
    greedy_tokens: Annotated[
        int, typer.Option("--greedy-tokens", min=0, help="Greedy tokens compared after the suffix (0: skip).")
    ] = 64,
    source: ManifestSourceOpt = None,
    target: ManifestTargetOpt = None,
    device: Annotated[str, typer.Option("--device", help="Torch device for both models.")] = "cpu",
    repair: Annotated[
        list[float] | None,
        typer.Option("--repair", min=0.0, max=1.0, help="Also score map-then-repair with this budget (share of "
                     "the target's own prefill, priced as --repair-costs says); repeat for a curve."),
    ] = None,
    repair_layers: Annotated[
        float, typer.Option("--repair-layers", min=0.0, max=1.0, help="Share of each repair budget spent on layer "
                            "blocks (needs residual maps: `orchestra calibrate-repair`).")
    ] = 0.0,
    repair_costs: Annotated[
        Literal["measured", "compute"], typer.Option("--repair-costs", help="How repair budgets and planned costs are priced: 'measured' (this "
                          "machine's timed passes of the target, kept beside the mapping) or 'compute' "
                          "(multiply-adds).")
    ] = "measured",
    timing_repeats: Annotated[
        int, typer.Option("--timing-repeats", min=1, help="Time the target's prefill and each repair as the "
                          "fastest of this many runs (on a shared machine one run can take twice the next).")
    ] = 2,
    repair_scattered: Annotated[
        float, typer.Option("--repair-scattered", min=0.0, max=1.0, help="Share of the token budget spent on "
                            "interior tokens the source's last tokens attend to most.")
    ] = 0.0,
    no_curves: Annotated[
        bool, typer.Option("--no-layer-curves", help="Skip single-layer and accumulation curves (faster).")
    ] = False,
    served: Annotated[
        bool, typer.Option("--served/--no-served", help="Also score what an agent gets: the FamilyCache's cache of "
                           "the target under the default gates (mapped, or re-prefilled when a gate refuses).")
    ] = True,
    encoding: EncodingOpt = None,
) -> None:
    """Compare mapped caches with the target's own prefill on DOCUMENT; print a table, optionally write JSON."""
    from rich.table import Table

    from mappings.errors import MappingError
    from orchestra.commands._output import console
    from orchestra.errors import OrchestraError

    try:
        from mappings.evaluate import EvaluationSettings, evaluate, write_report
        from mappings.repair import RepairPolicy

        text = _read_text(document, encoding, what="document")
        policies = [RepairPolicy(budget=b, layer_share=repair_layers, scattered_share=repair_scattered)
                    for b in (repair or [])]
        settings = EvaluationSettings(
            prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens, windows=windows, tail_tokens=tail_tokens,
            sink_tokens=sink_tokens, greedy_tokens=greedy_tokens, layer_curves=not no_curves, repairs=policies,
            repair_costs=repair_costs, timing_repeats=timing_repeats, device=device,
        )
        src_ref, tgt_ref = _pair_refs(mapping, source, target)
        src, tgt = _load(src_ref, device), _load(tgt_ref, device)
        report = evaluate(mapping, text, settings, source=src, target=tgt, document_name=document.name)
        own = next((r for r in report.methods if r.method == report.mapping_method), None)
        if own is not None and not (own.kl == own.kl and abs(own.kl) != float("inf")):
            from mappings.errors import NonFiniteKVError

            raise NonFiniteKVError(f"the mapping in {mapping} gives non-finite next-token KL ({own.kl}) on this "
                                   "document: its maps overflow or are broken; recalibrate it")
        served_report = None
        if served:
            from orchestra.familycache.served import evaluate_served

            ids = list(tgt.tokenizer(text, add_special_tokens=False)["input_ids"])
            # the references as given: the registry resolves them to the same folders and fingerprints
            served_report = evaluate_served(mapping, ids, source=str(src_ref),
                                            target=str(tgt_ref), prefix_tokens=prefix_tokens,
                                            suffix_tokens=suffix_tokens, windows=windows, device=device)
        if json_out is not None:
            report = write_report(report, json_out)
            if served_report is not None:
                _write_json(json_out.with_name(json_out.stem + "_served.json"), served_report.model_dump(mode="json"))
    except (MappingError, OrchestraError, ValueError, FileNotFoundError) as exc:
        raise _fail(exc) from exc

    table = Table(title=f"{report.mapping_method}: {document.name}, {report.windows} x (prefix {report.prefix_tokens} "
                        f"+ suffix {report.suffix_tokens}) tokens")
    for col in ("method", "KL", "top-1", "top-5", "NLL Δ", "greedy", "map s", "prefill s", "cost", "measured",
                "tokens"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    for r in report.methods:
        greedy = "-" if r.greedy_agreement is None else f"{r.greedy_agreement:.1f}/{r.greedy_tokens}"
        nll = "-" if r.nll_delta is None else f"{r.nll_delta:+.4f}"
        table.add_row(r.method, f"{r.kl:.4f}", f"{r.top1:.3f}", f"{r.top5:.3f}", nll, greedy,
                      f"{r.map_seconds:.4f}", f"{r.prefill_seconds:.3f}", pct(r.cost_fraction), pct(r.measured_cost),
                      pct(r.token_share))
    console.print(table)
    console.print("cost: planned target compute (multiply-adds counting attention) / the target's own prefill; "
                  "measured: target seconds / that prefill's seconds; tokens: recomputed tokens / prefix "
                  "(+ layers / layers)")
    if served_report is not None:
        paths = ", ".join(f"{w.path}" + (f" ({w.fallback_reason})" if w.fallback_reason else "")
                          for w in served_report.windows)
        console.print(f"served by FamilyCache (default gates): KL {served_report.kl:.4f}, top-1 "
                      f"{served_report.top1:.3f}; {paths}")
    console.print(f"source {report.source['fingerprint']['combined'][:12]} -> "
                  f"target {report.target['fingerprint']['combined'][:12]}; source prefill "
                  f"{report.source_prefill_seconds:.3f}s, target prefill {report.reference_prefill_seconds:.3f}s")
    for name, why in report.skipped.items():
        console.print(f"skipped {name}: {why}")
    if json_out is not None:
        console.print(f"wrote {json_out}" + (f" and {', '.join(report.plots)}" if report.plots else ""))
