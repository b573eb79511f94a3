"""Save and load mappings: safetensors tensors + a JSON manifest, no pickle.

A mapping directory holds ``manifest.json``, ``mapping.safetensors`` (per-layer weights and
biases) and optionally ``stats.safetensors`` (the calibration statistics, so baselines can be
refitted without capturing the corpus again). The manifest records the sha256 of each tensor
file; loading verifies it, so a truncated or edited file is an error, never a garbage cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mappings.errors import CorruptMappingError, StaleMappingError
from mappings.manifest import (
    MANIFEST_FILE,
    MAPPING_VERSION,
    READABLE_VERSIONS,
    RESIDUAL_FILE,
    STATS_FILE,
    TENSORS_FILE,
    FileRecord,
    LayerPlanEntry,
    MappingManifest,
)

if TYPE_CHECKING:
    import torch

    from mappings.apply import LinearKVMap
    from mappings.fingerprint import Fingerprint
    from mappings.fit import LayerStats
    from mappings.residual import ResidualMap
    from mappings.types import CacheLike, DeviceLike, KVCache, Model

__all__ = ["Mapping", "save_mapping", "load_mapping", "read_manifest", "map_tensors", "map_from_tensors",
           "file_sha256", "check_out_dir"]


@dataclass
class Mapping:
    """A fitted map with its manifest (and, optionally, its calibration statistics)."""

    kv_map: LinearKVMap
    manifest: MappingManifest
    stats: list[LayerStats] | None = None
    path: Path | None = None
    residual: ResidualMap | None = None
    """Residual-stream maps for layer repair (``mappings.residual``), when fitted."""

    def save(self, out_dir: str | Path, *, with_stats: bool = True) -> Path:
        return save_mapping(self, out_dir, with_stats=with_stats)

    def map_cache(self, source_cache: CacheLike, target_model: Model,
                  positions: torch.Tensor | None = None) -> KVCache:
        from mappings.apply import map_cache

        return map_cache(self.kv_map, source_cache, target_model, positions)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def map_tensors(kv_map: LinearKVMap) -> dict[str, torch.Tensor]:
    """The map's tensors under stable names (``layers.{t}.k.weight``, ``.k.bias``, ``.k.down``, ...)."""
    out = {}
    for t, lm in enumerate(kv_map.layers):
        for name, tensor in lm.tensors().items():
            out[f"layers.{t}.{name}"] = tensor.detach().float().cpu().contiguous()
    return out


def _stats_tensors(stats: list[LayerStats]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for t, ls in enumerate(stats):
        out.update(ls.keys.to_tensors(f"layers.{t}.k"))
        out.update(ls.values.to_tensors(f"layers.{t}.v"))
    return {k: v.contiguous() for k, v in out.items()}


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path, step: str) -> FileRecord:
    from safetensors.torch import save_file

    from mappings.atomic import fault_point, publish_mode

    fault_point(f"mapping.{step}")
    # One metadata key only: safetensors orders several keys randomly, which would change the file hash.
    save_file(tensors, str(path), metadata={"mapping_version": str(MAPPING_VERSION)})
    publish_mode(path)
    return FileRecord(name=path.name, sha256=file_sha256(path), bytes=path.stat().st_size)


_OWN_FILES = {MANIFEST_FILE, TENSORS_FILE, STATS_FILE, RESIDUAL_FILE}


def check_out_dir(out: Path) -> bool:
    """Whether `out` holds a mapping (complete or half-written) to replace; refuse anything else but a new or empty folder."""
    from mappings.errors import MappingOutputError

    if not out.exists() and not out.is_symlink():
        return False
    if not out.is_dir():
        raise MappingOutputError(f"{out} exists and is not a folder; pass a new folder (or a mapping folder) to write the mapping into")
    entries = [p for p in out.iterdir() if not p.name.startswith(".")]
    if not entries:
        return False
    if (out / MANIFEST_FILE).is_file() or any(p.suffix == ".safetensors" for p in entries):
        if not (out / MANIFEST_FILE).is_file():
            import logging

            logging.getLogger("orchestra.documents.files").warning(
                "%s is a half-written mapping (no %s): replacing it", out, MANIFEST_FILE)
        return True
    raise MappingOutputError(
        f"{out} is a folder with other files in it (no mapping); pass a new or empty folder to write the mapping into"
    )


def _carry_over(old: Path, new: Path, written: set[str]) -> None:
    """Files a user or a later step put beside an old mapping (probe references, reports) move to its successor."""
    import shutil

    for entry in old.iterdir():
        if entry.name in _OWN_FILES or entry.name in written or entry.name.startswith("."):
            continue
        target = new / entry.name
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target, symlinks=True)
            continue
        try:
            os.link(entry, target, follow_symlinks=False)
        except OSError:
            shutil.copy2(entry, target, follow_symlinks=False)


def _portable_path(model_path: str | None, out: Path) -> str | None:
    """A model folder near the mapping (the same family home) is stored relative to the mapping folder."""
    if not model_path or not Path(model_path).is_absolute():
        return model_path
    try:
        rel = os.path.relpath(model_path, out.resolve())
    except ValueError:  # another drive
        return model_path
    return rel if rel.split(os.sep)[:3].count("..") <= 2 else model_path


def save_mapping(mapping: Mapping, out_dir: str | Path, *, with_stats: bool = True) -> Path:
    """Write the mapping directory crash-safely.

    Everything is written into a temporary sibling folder (tensors first, manifest last) that then
    replaces `out_dir` in one step: an existing mapping there stays intact and loadable until its
    successor is complete, and an interrupted save leaves only a hidden temporary folder, removed
    with a warning by the next save. Other files beside an old mapping are kept.
    """
    from mappings.atomic import fault_point, install_dir, temp_dir, write_atomic

    out = Path(out_dir)
    replacing = check_out_dir(out)
    tmp = temp_dir(out)
    try:
        tensors = _write_safetensors(map_tensors(mapping.kv_map), tmp / TENSORS_FILE, "tensors")
        stats = None
        if with_stats and mapping.stats is not None:
            stats = _write_safetensors(_stats_tensors(mapping.stats), tmp / STATS_FILE, "stats")
        update: dict[str, object] = {"tensors": tensors, "stats": stats}
        if mapping.manifest.repair is not None:
            residual = None
            if mapping.residual is not None:
                residual = _write_safetensors(mapping.residual.tensors(), tmp / RESIDUAL_FILE, "residual")
            update["repair"] = mapping.manifest.repair.model_copy(update={"residual": residual})
        manifest = mapping.manifest.model_copy(update=update)
        on_disk = manifest.model_copy(update={
            side: getattr(manifest, side).model_copy(update={"path": _portable_path(getattr(manifest, side).path, out)})
            for side in ("source", "target")
        })
        fault_point("mapping.manifest")
        write_atomic(tmp / MANIFEST_FILE, on_disk.model_dump_json(indent=2) + "\n")
        if replacing:
            _carry_over(out, tmp, set())
        install_dir(tmp, out, step="mapping")
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    mapping.manifest = manifest
    mapping.path = out
    return out


def read_manifest(mapping_dir: str | Path) -> MappingManifest:
    """Parse and validate ``manifest.json``; :class:`CorruptMappingError` when missing or invalid."""
    from pydantic import ValidationError

    path = Path(mapping_dir) / MANIFEST_FILE
    if not path.is_file() and not Path(mapping_dir).exists():
        from mappings.atomic import recover_dir

        recover_dir(mapping_dir)  # a replace cut short between its two renames (platforms without an atomic swap)
    if not path.is_file():
        raise CorruptMappingError(f"{path} is missing: {mapping_dir} is not a mapping directory; run `orchestra calibrate`")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptMappingError(f"{path} is not valid JSON ({exc}); recalibrate into a fresh directory") from exc
    if isinstance(raw, dict) and raw.get("mapping_version") not in (None, *READABLE_VERSIONS):
        raise StaleMappingError(
            f"{mapping_dir} was written by mapping format v{raw.get('mapping_version')}, this code reads "
            f"v{READABLE_VERSIONS[0]} to v{MAPPING_VERSION}: recalibrate with `orchestra calibrate`"
        )
    try:
        manifest = MappingManifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise CorruptMappingError(
            f"{path} does not describe a mapping ({where}: {first.get('msg')}); recalibrate into a fresh directory"
        ) from exc
    # model folders stored relative to the mapping (a family home moved or copied as a whole)
    sides = {}
    for side in ("source", "target"):
        info = getattr(manifest, side)
        if info.path and not Path(info.path).is_absolute():
            sides[side] = info.model_copy(update={"path": str((Path(mapping_dir) / info.path).resolve())})
    return manifest.model_copy(update=sides) if sides else manifest


def _load_tensors(path: Path, record: FileRecord, *, finite: bool = True) -> dict[str, torch.Tensor]:
    import torch
    from safetensors.torch import load_file

    folder = path.parent.resolve()
    if path.name != record.name or path.resolve().parent != folder or path.is_symlink():
        raise CorruptMappingError(
            f"{folder}: the manifest names tensor file {record.name!r}, which is not a plain file in the mapping "
            "folder; recalibrate the mapping"
        )
    if not path.is_file():
        raise CorruptMappingError(f"{path} is missing; recalibrate the mapping")
    if path.stat().st_size != record.bytes or file_sha256(path) != record.sha256:
        raise CorruptMappingError(
            f"{path} does not match its manifest (size or sha256 differ: truncated or modified); "
            "recalibrate the mapping"
        )
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types
        raise CorruptMappingError(f"{path} is not a readable safetensors file ({exc}); recalibrate") from exc
    if finite:
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise CorruptMappingError(
                    f"{path} holds NaN or inf values (tensor {name}): the mapping is unusable; recalibrate it"
                )
    return tensors


def map_from_tensors(manifest: MappingManifest, tensors: dict[str, torch.Tensor],
                     device: DeviceLike = "cpu") -> LinearKVMap:
    """Rebuild the :class:`LinearKVMap` a manifest and its tensors describe."""
    from mappings.apply import LayerMap, LinearKVMap
    from mappings.capture import KVShape
    from mappings.rope import RopeSpec, config_from_dict

    try:
        src_rope = RopeSpec.from_config(config_from_dict(manifest.source.config))
        tgt_rope = RopeSpec.from_config(config_from_dict(manifest.target.config))
    except Exception as exc:
        raise CorruptMappingError(f"cannot rebuild the models' RoPE from the manifest ({exc}); recalibrate") from exc
    s, t = KVShape(**manifest.source.kv_shape), KVShape(**manifest.target.kv_shape)
    layers = []
    plan: list[LayerPlanEntry] = sorted(manifest.layer_plan, key=lambda e: e.target_layer)
    if [e.target_layer for e in plan] != list(range(t.num_layers)):
        raise CorruptMappingError("the manifest's layer plan does not cover every target layer; recalibrate")
    for e in plan:
        if any(not 0 <= i < s.num_layers for i in e.sources) or not e.sources:
            raise CorruptMappingError(f"layer {e.target_layer} names source layers {e.sources} that do not exist")
        if e.mode == "passthrough":
            layers.append(LayerMap(tuple(e.sources), "passthrough"))
            continue
        pre = f"layers.{e.target_layer}"
        p, q = len(e.sources) * s.width, t.width
        parts = ("down", "up") if e.form == "lowrank" else ("weight",)
        found: dict[str, torch.Tensor] = {}
        for kind in ("k", "v"):
            for part in parts:
                name = f"{pre}.{kind}.{part}"
                if name not in tensors:
                    raise CorruptMappingError(f"tensor {name} is missing from {TENSORS_FILE}; recalibrate")
                found[f"{kind}_{part}"] = tensors[name].to(device)
            if e.bias:
                name = f"{pre}.{kind}.bias"
                if name not in tensors:
                    raise CorruptMappingError(f"tensor {name} is missing from {TENSORS_FILE}; recalibrate")
                found[f"{kind}_bias"] = tensors[name].to(device)
        for kind in ("k", "v"):
            if e.form == "lowrank":
                down, up = found[f"{kind}_down"], found[f"{kind}_up"]
                ok = down.dim() == up.dim() == 2 and down.shape[0] == p and up.shape[1] == q and down.shape[1] == up.shape[0]
                shape = f"{tuple(down.shape)} x {tuple(up.shape)}"
            else:
                ok = tuple(found[f"{kind}_weight"].shape) == (p, q)
                shape = str(tuple(found[f"{kind}_weight"].shape))
            if not ok:
                raise CorruptMappingError(
                    f"layer {e.target_layer} {kind} map has shape {shape}, expected {(p, q)}; recalibrate"
                )
        layers.append(LayerMap(
            tuple(e.sources), "map", alpha=e.alpha, anchored=e.anchored,
            k_weight=found.get("k_weight"), k_bias=found.get("k_bias"), v_weight=found.get("v_weight"),
            v_bias=found.get("v_bias"), k_down=found.get("k_down"), k_up=found.get("k_up"),
            v_down=found.get("v_down"), v_up=found.get("v_up"),
        ))
    return LinearKVMap(layers, s, t, src_rope, tgt_rope, key_space=manifest.method.key_space)


def load_mapping(
    mapping_dir: str | Path,
    source_fp: Fingerprint | dict[str, str] | str | None = None,
    target_fp: Fingerprint | dict[str, str] | str | None = None,
    *,
    device: DeviceLike = "cpu",
    with_stats: bool = False,
) -> Mapping:
    """Load a mapping directory, refusing stale (:class:`StaleMappingError`) or corrupt ones.

    Pass the fingerprints of the models you will use: a mapping made for other models is refused.
    ``with_stats`` also loads the calibration statistics (needed to refit baselines).
    """
    from mappings.fingerprint import check_fingerprints
    from mappings.fit import LayerStats, RegressionStats

    mapping_dir = Path(mapping_dir)
    manifest = read_manifest(mapping_dir)
    check_fingerprints(manifest, source_fp, target_fp)
    tensors = _load_tensors(mapping_dir / manifest.tensors.name, manifest.tensors)
    kv_map = map_from_tensors(manifest, tensors, device)
    stats = None
    if with_stats and manifest.stats is not None:
        raw = _load_tensors(mapping_dir / manifest.stats.name, manifest.stats, finite=False)
        try:
            stats = [
                LayerStats(RegressionStats.from_tensors(raw, f"layers.{t}.k"),
                           RegressionStats.from_tensors(raw, f"layers.{t}.v"))
                for t in range(kv_map.target_shape.num_layers)
            ]
        except KeyError as exc:
            raise CorruptMappingError(f"tensor {exc.args[0]} is missing from {STATS_FILE}; recalibrate") from exc
    residual = None
    if manifest.repair is not None and manifest.repair.residual is not None:
        from mappings.residual import ResidualMap

        raw = _load_tensors(mapping_dir / manifest.repair.residual.name, manifest.repair.residual)
        residual = ResidualMap.from_tensors({k: v.to(device) for k, v in raw.items()})
        if len(residual.layers) != kv_map.target_shape.num_layers:
            raise CorruptMappingError(
                f"{RESIDUAL_FILE} maps {len(residual.layers)} layers, the target has "
                f"{kv_map.target_shape.num_layers}; recalibrate the repair maps"
            )
    return Mapping(kv_map, manifest, stats, mapping_dir, residual)
