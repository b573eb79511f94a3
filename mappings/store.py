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
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mappings.errors import CorruptMappingError, StaleMappingError
from mappings.manifest import (
    MANIFEST_FILE,
    MAPPING_VERSION,
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

__all__ = ["Mapping", "save_mapping", "load_mapping", "read_manifest", "map_tensors", "map_from_tensors",
           "file_sha256"]


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

    def map_cache(self, source_cache: Any, target_model: Any, positions: torch.Tensor | None = None) -> Any:
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
    out: dict[str, Any] = {}
    for t, ls in enumerate(stats):
        out.update(ls.keys.to_tensors(f"layers.{t}.k"))
        out.update(ls.values.to_tensors(f"layers.{t}.v"))
    return {k: v.contiguous() for k, v in out.items()}


def _publish(tmp: str, path: Path) -> None:
    """Give a temp file the usual permissions (mkstemp makes it 0600) and move it into place."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> FileRecord:
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        # One metadata key only: safetensors orders several keys randomly, which would change the file hash.
        save_file(tensors, tmp, metadata={"mapping_version": str(MAPPING_VERSION)})
        _publish(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return FileRecord(name=path.name, sha256=file_sha256(path), bytes=path.stat().st_size)


def save_mapping(mapping: Mapping, out_dir: str | Path, *, with_stats: bool = True) -> Path:
    """Write the mapping directory (tensors first, manifest last, each file atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _write_safetensors(map_tensors(mapping.kv_map), out / TENSORS_FILE)
    stats = None
    if with_stats and mapping.stats is not None:
        stats = _write_safetensors(_stats_tensors(mapping.stats), out / STATS_FILE)
    elif (out / STATS_FILE).exists():
        (out / STATS_FILE).unlink()
    update: dict[str, Any] = {"tensors": tensors, "stats": stats}
    if mapping.manifest.repair is not None:
        residual = None
        if mapping.residual is not None:
            residual = _write_safetensors(mapping.residual.tensors(), out / RESIDUAL_FILE)
        elif (out / RESIDUAL_FILE).exists():
            (out / RESIDUAL_FILE).unlink()
        update["repair"] = mapping.manifest.repair.model_copy(update={"residual": residual})
    manifest = mapping.manifest.model_copy(update=update)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{MANIFEST_FILE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(manifest.model_dump_json(indent=2))
            fh.write("\n")
        _publish(tmp, out / MANIFEST_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    mapping.manifest = manifest
    mapping.path = out
    return out


def read_manifest(mapping_dir: str | Path) -> MappingManifest:
    """Parse and validate ``manifest.json``; :class:`CorruptMappingError` when missing or invalid."""
    from pydantic import ValidationError

    path = Path(mapping_dir) / MANIFEST_FILE
    if not path.is_file():
        raise CorruptMappingError(f"{path} is missing: {mapping_dir} is not a mapping directory; run `orchestra calibrate`")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptMappingError(f"{path} is not valid JSON ({exc}); recalibrate into a fresh directory") from exc
    if isinstance(raw, dict) and raw.get("mapping_version") not in (None, MAPPING_VERSION):
        raise StaleMappingError(
            f"{mapping_dir} was written by mapping format v{raw.get('mapping_version')}, this code reads "
            f"v{MAPPING_VERSION}: recalibrate with `orchestra calibrate`"
        )
    try:
        return MappingManifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise CorruptMappingError(
            f"{path} does not describe a mapping ({where}: {first.get('msg')}); recalibrate into a fresh directory"
        ) from exc


def _load_tensors(path: Path, record: FileRecord) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise CorruptMappingError(f"{path} is missing; recalibrate the mapping")
    if path.stat().st_size != record.bytes or file_sha256(path) != record.sha256:
        raise CorruptMappingError(
            f"{path} does not match its manifest (size or sha256 differ: truncated or modified); "
            "recalibrate the mapping"
        )
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types
        raise CorruptMappingError(f"{path} is not a readable safetensors file ({exc}); recalibrate") from exc


def map_from_tensors(manifest: MappingManifest, tensors: dict[str, torch.Tensor], device: Any = "cpu") -> LinearKVMap:
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
        found: dict[str, Any] = {}
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
        layers.append(LayerMap(tuple(e.sources), "map", alpha=e.alpha, anchored=e.anchored, **found))
    return LinearKVMap(layers, s, t, src_rope, tgt_rope, key_space=manifest.method.key_space)


def load_mapping(
    mapping_dir: str | Path,
    source_fp: Fingerprint | dict[str, str] | str | None = None,
    target_fp: Fingerprint | dict[str, str] | str | None = None,
    *,
    device: Any = "cpu",
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
        raw = _load_tensors(mapping_dir / manifest.stats.name, manifest.stats)
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
