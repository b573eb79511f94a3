"""Calibration cost: seconds to fit, tokens, and artifact bytes against the model's bytes.

Two sources: the manifests of the mappings in the store (the real, full-size calibrations, as
they were run), and one calibration timed in this run on ``tokens`` tokens (small under
``--quick``), saved to a scratch folder to weigh its files. The timed one is never stored.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from orchestra.bench._context import BenchFamily, Pair

__all__ = ["CalibrationBenchConfig", "CalibrationRow", "CalibrationSection", "run_calibration", "artifact_bytes"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CalibrationBenchConfig(_Model):
    pairs: list[Pair] = Field(description="pairs whose stored manifests are read")
    timed_pair: Pair | None = Field(None, description="pair calibrated (and timed) in this run; None: skip")
    tokens: int = Field(2048, ge=16, description="fitting tokens of the timed calibration")
    window: int = Field(512, ge=8, description="tokens per window of the timed calibration")
    method: str = "auto"


class CalibrationRow(_Model):
    pair: str
    origin: str = Field(description="'store' (manifest of the stored mapping) or 'timed' (fitted in this run)")
    method: str
    seconds: float = Field(description="wall seconds of the calibration")
    tokens: int = Field(description="fitting tokens")
    heldout_tokens: int
    heldout_kl: float | None
    heldout_kl_identity: float | None
    map_bytes: int = Field(description="mapping.safetensors: what inference needs")
    stats_bytes: int = Field(description="stats.safetensors: calibration statistics, only for refitting baselines")
    manifest_bytes: int
    model_bytes: int = Field(description="the target model's weight files")
    map_fraction_of_model: float = Field(description="map bytes / target model bytes")
    artifact_fraction_of_model: float = Field(description="all artifact bytes / target model bytes")
    path: str | None = None


class CalibrationSection(_Model):
    config: CalibrationBenchConfig
    rows: list[CalibrationRow] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)


def artifact_bytes(path: Path) -> tuple[int, int, int]:
    """(map, stats, manifest) bytes of a mapping directory (0 for a missing file)."""
    def size(name: str) -> int:
        p = path / name
        return p.stat().st_size if p.is_file() else 0

    return size("mapping.safetensors"), size("stats.safetensors"), size("manifest.json")


def _row(pair: str, origin: str, path: Path, model_bytes: int, seconds: float | None = None) -> CalibrationRow:
    from mappings.store import read_manifest

    manifest = read_manifest(path)
    mb, sb, jb = artifact_bytes(path)
    cal = manifest.calibration
    return CalibrationRow(
        pair=pair, origin=origin, method=manifest.method.name,
        seconds=seconds if seconds is not None else cal.seconds, tokens=cal.token_count,
        heldout_tokens=cal.heldout_tokens, heldout_kl=manifest.heldout.get("kl"),
        heldout_kl_identity=manifest.heldout.get("kl_identity"), map_bytes=mb, stats_bytes=sb, manifest_bytes=jb,
        model_bytes=model_bytes, map_fraction_of_model=mb / model_bytes if model_bytes else 0.0,
        artifact_fraction_of_model=(mb + sb + jb) / model_bytes if model_bytes else 0.0,
        path=str(path) if origin == "store" else None,
    )


def run_calibration(config: CalibrationBenchConfig, fam: BenchFamily, *, progress: bool = True) -> CalibrationSection:
    from mappings.calibrate import CalibrationSettings, calibrate

    section = CalibrationSection(config=config)
    for pair in config.pairs:
        path = fam.mapping_path(pair)
        if not (path / "manifest.json").is_file():
            section.skipped.append(f"{pair.label}: no stored mapping in {fam.store.directory}")
            continue
        section.rows.append(_row(pair.label, "store", path, fam.model_bytes(pair.target)))
    if config.timed_pair is not None:
        pair = config.timed_pair
        src, tgt = fam.handle(pair.source), fam.handle(pair.target)
        t0 = time.perf_counter()
        settings = CalibrationSettings(method=config.method, tokens=config.tokens, window=config.window,
                                       device=fam.device)
        mapping = calibrate(src, tgt, fam.store.corpus, settings, progress=progress)
        seconds = time.perf_counter() - t0
        with tempfile.TemporaryDirectory(prefix="orchestra-bench-cal-") as tmp:
            out = mapping.save(Path(tmp) / "mapping")
            section.rows.append(_row(pair.label, "timed", out, fam.model_bytes(pair.target), seconds))
    return section
