"""Calibrate root -> member mappings into a family's mapping store, offline.

One implementation behind ``orchestra family build`` (which calibrates every member by default, so
that a pipeline run never calibrates on demand) and ``orchestra family calibrate``. Each mapping is
written crash-safely: the new mapping is fitted in memory and saved into a temporary sibling folder
that replaces the old one only when complete (``Mapping.save``), so an interrupted calibration leaves
the previous mapping usable, or none.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mappings.store import Mapping
    from orchestra.family.manifest import FamilyManifest
    from orchestra.familycache.mapping_store import MappingStore
    from orchestra.models.registry import LoadedModel, ModelInfo, ModelRegistry

__all__ = ["CALIBRATION_TOKENS", "REPAIR_TOKENS", "Calibrated", "calibrate_members"]

# What pipelines calibrate with on demand (MappingStore's default, `mapping: tokens:` of the bundled
# example) and what `orchestra family calibrate` uses: a mapping made at build time is the one a run
# would otherwise have made for itself, so reusing it changes no result.
CALIBRATION_TOKENS = 8192
# Residual-stream maps (layer repair) need fewer windows than the KV maps; 4096 is the command's cap.
REPAIR_TOKENS = 4096

Log = Callable[[str], None]


@dataclass(frozen=True)
class Calibrated:
    """What happened to one root -> member pair."""

    member: str
    path: Path
    made: bool  # calibrated now (False: an existing, loadable mapping was kept)
    seconds: float
    method: str
    heldout_kl: float
    residual: bool


@dataclass(frozen=True)
class _Calibration:
    """What every pair of one `calibrate_members` call shares: the models, the store and the settings."""

    registry: ModelRegistry
    store: MappingStore
    root_info: ModelInfo
    tokens: int
    repair: bool
    force: bool
    say: Log


def calibrate_members(
    manifest: FamilyManifest,
    members: Sequence[str] | None = None,
    *,
    tokens: int = CALIBRATION_TOKENS,
    repair: bool = True,
    force: bool = False,
    log: Log | None = None,
    progress: bool = True,
) -> list[Calibrated]:
    """Calibrate root -> each of `members` (names or roles; default: every non-root member).

    An existing mapping is loaded and checked, and kept unless `force`; a corrupt, stale or
    half-written one is replaced (with a warning through `log`). With `repair`, residual-stream
    maps are fitted too (added to a kept mapping that lacks them).
    """
    from orchestra.familycache.mapping_store import MappingStore
    from orchestra.models.registry import ModelRegistry

    say = log or (lambda _msg: None)
    chosen = [m for m in manifest.members.values() if m.role != "root"]
    if members is not None:
        chosen = [manifest.member(name) for name in members]
    if not chosen:
        return []
    aliases = {"root": "root", **{m.name: m.name for m in chosen}}
    registry = ModelRegistry(aliases, family=manifest, default_device="cpu")
    store = MappingStore(Path(manifest.home) / "mappings", tokens=tokens)
    run = _Calibration(registry=registry, store=store, root_info=registry.info("root"), tokens=tokens,
                       repair=repair, force=force, say=say)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(chosen), desc="calibrating root -> members", unit="pair")
    results: list[Calibrated] = []
    try:
        for member in chosen:
            if bar is not None:
                bar.set_postfix_str(member.name)
            results.append(_calibrate_member(run, member.name))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return results


def _calibrate_member(run: _Calibration, member: str) -> Calibrated:
    """Root -> `member`: its mapping kept when it needs no work, else loaded (and completed) or fitted."""
    started = time.perf_counter()
    path = run.store.path_for(run.root_info, run.registry.info(member))
    kept = None if run.force else _kept(path, run.repair)
    if kept is not None:  # nothing to do: no member is loaded (a demo start stays quick)
        method, kl, residual = kept
        return Calibrated(member=member, path=path, made=False, seconds=time.perf_counter() - started,
                          method=method, heldout_kl=kl, residual=residual)
    source = run.registry.load("root")  # loaded once, by the first pair that needs work
    target = run.registry.load(member)
    mapping, made = _load_or_fit(run.store, path, source, target, member, tokens=run.tokens,
                                 repair=run.repair, force=run.force, say=run.say)
    heldout_kl = mapping.manifest.heldout.get("kl")
    return Calibrated(
        member=member, path=path, made=made, seconds=time.perf_counter() - started,
        method=mapping.manifest.method.name, heldout_kl=float("nan") if heldout_kl is None else heldout_kl,
        residual=mapping.residual is not None,
    )


def _load_or_fit(store: MappingStore, path: Path, source: LoadedModel, target: LoadedModel, member: str, *,
                 tokens: int, repair: bool, force: bool, say: Log) -> tuple[Mapping, bool]:
    """The mapping at ``path`` if it loads (residual maps added when ``repair`` wants them), else a fresh fit
    saved over it; and whether it was calibrated now."""
    from mappings.errors import MappingError

    mapping, made = None, False
    if not force and (path / "manifest.json").is_file():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mapping, made = store.get(source, target)
        except MappingError as exc:  # corrupt or stale: replaced below, the old folder kept until then
            say(f"warning: {path.name} is unusable ({exc}); recalibrating it")
    elif not force and path.exists():
        say(f"warning: {path.name} is a half-written mapping (no manifest); replacing it")
    if mapping is None:
        say(f"calibrating {source.info.name} -> {member} on {tokens} tokens ...")
        mapping = store.fit(source, target)
        if repair:
            from mappings.calibrate_repair import add_residual_maps

            add_residual_maps(mapping, source.info.path, target.info.path, store.corpus,
                              tokens=min(tokens, REPAIR_TOKENS))
        mapping.save(path)  # the previous mapping (if any) is replaced only now, complete
        made = True
    elif repair and mapping.residual is None:
        from mappings.calibrate_repair import add_residual_maps
        from mappings.store import load_mapping

        with_stats = load_mapping(path, with_stats=True)
        add_residual_maps(with_stats, source.info.path, target.info.path, store.corpus,
                          tokens=min(tokens, REPAIR_TOKENS))
        with_stats.save(path, with_stats=with_stats.stats is not None)
        mapping = with_stats
    return mapping, made


def _kept(path: Path, repair: bool) -> tuple[str, float, bool] | None:
    """(method, held-out KL, has residual maps) of a complete mapping at `path` that needs no work, else None.

    Reads only its manifest: the folder name carries both fingerprints, and a run checks them again
    (and the tensors) when it loads the mapping, so a mapping broken inside is still caught there.
    """
    import json

    try:
        manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
        residual = bool((manifest.get("repair") or {}).get("residual"))
        method, kl = str(manifest["method"]["name"]), float(manifest["heldout"].get("kl", float("nan")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if repair and not residual:
        return None
    if not all((path / name).is_file() for name in ("mapping.safetensors",)):
        return None
    return method, kl, residual
