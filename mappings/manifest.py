"""The JSON manifest of a saved mapping (pydantic): what it maps, how it was fitted, how good it is.

Its identity fields double as the cache key of any KV produced with it (the seed's section 5.3:
source and target model versions, dtype, RoPE parameters, mapping version).
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mappings.methods import MethodSpec

__all__ = [
    "MAPPING_VERSION",
    "READABLE_VERSIONS",
    "MANIFEST_FILE",
    "TENSORS_FILE",
    "STATS_FILE",
    "ModelInfo",
    "LayerPlanEntry",
    "KVFitMetrics",
    "LayerMetrics",
    "CalibrationInfo",
    "FileRecord",
    "RepairInfo",
    "MappingManifest",
]

MAPPING_VERSION = 2
"""Bump whenever the on-disk format or the meaning of a stored tensor changes.

v2: ``exact_layers`` (leading layers whose K/V the two models compute identically, passed through)."""

READABLE_VERSIONS = (1, 2)
"""Versions this code loads: a v1 manifest reads as v2 with no exact layers (its tensors mean the same)."""

MANIFEST_FILE = "manifest.json"
TENSORS_FILE = "mapping.safetensors"
STATS_FILE = "stats.safetensors"
RESIDUAL_FILE = "residual.safetensors"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelInfo(_Model):
    """One side of the pair."""

    path: str | None = Field(default=None, description="where the model was loaded from, if a folder")
    fingerprint: dict[str, str] = Field(description="sha256 of config, weights, tokenizer and combined")
    dtype: str = Field(description="parameter dtype at calibration")
    kv_shape: dict[str, int] = Field(description="num_layers, kv_heads, head_dim")
    rope: dict[str, object] = Field(description="RoPE type and parameters")
    config: dict[str, object] = Field(description="the model config (to rebuild RoPE without the model)")


class LayerPlanEntry(_Model):
    """How one target layer is produced."""

    target_layer: int = Field(description="target layer index")
    sources: list[int] = Field(description="source layers concatenated as input")
    mode: Literal["map", "passthrough"] = Field(description="mapped, or source layer copied unchanged")
    alpha: float | None = Field(default=None, description="chosen relative ridge strength (None: pass-through)")
    bias: bool = Field(default=False, description="whether a bias tensor is stored")
    form: Literal["passthrough", "dense", "lowrank"] = Field(
        default="dense", description="how the weights are stored: one matrix, or low-rank factors"
    )
    anchored: bool = Field(default=False, description="low-rank form: identity anchor added to the factors")


class KVFitMetrics(_Model):
    """Held-out fit quality of one tensor kind in one layer."""

    cosine: float = Field(description="mean per-token cosine(mapped, true), all heads together")
    rel_mse: float = Field(description="‖mapped − true‖² / ‖true‖²")
    r2: float = Field(description="1 − SSE / centred total sum of squares")


class LayerMetrics(_Model):
    """Held-out metrics of one target layer."""

    layer: int
    keys: KVFitMetrics = Field(description="keys, compared as cached (target RoPE applied)")
    values: KVFitMetrics
    attn_cosine: float | None = Field(
        default=None,
        description="cosine of the target's attention output (true Q) with mapped vs true K/V of this layer",
    )
    identity_attn_cosine: float | None = Field(default=None, description="same with the source K/V unchanged")
    kl: float | None = Field(default=None, description="held-out next-token KL after the selection sweep")
    kl_by_option: dict[str, float] | None = Field(default=None, description="held-out KL of each option tried")


class CalibrationInfo(_Model):
    """What the map was fitted on."""

    corpus_sha256: str = Field(description="sha256 over the calibration texts (in order)")
    corpus_names: list[str] = Field(default_factory=list, description="names of the calibration texts")
    token_count: int = Field(description="tokens the map was fitted on")
    heldout_tokens: int = Field(description="tokens used for selection and metrics")
    window: int = Field(description="tokens per window")
    stride: int = Field(description="start-to-start distance of the fitting windows (< window: overlapping)")
    train_windows: int
    heldout_windows: int
    heldout_from: str = Field(description="where the held-out windows came from")
    seconds: float = Field(description="wall time of the calibration")


class FileRecord(_Model):
    """A tensor file of the mapping directory."""

    name: str = Field(description="a plain file name inside the mapping folder (no folders, not hidden)")
    sha256: str
    bytes: int

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if (not value or value in {".", ".."} or value.startswith(".") or "/" in value or "\\" in value
                or "\x00" in value or len(value) > 255):
            raise ValueError(f"tensor file name {value!r} is not a plain file name inside the mapping folder")
        return value


class RepairInfo(_Model):
    """What map-then-repair reads: residual-stream maps and the per-layer scores blocks are chosen by."""

    residual: FileRecord | None = Field(default=None, description="residual-stream maps (safetensors)")
    layer_scores: list[float] = Field(
        description="per target layer, 1 - held-out attention-output cosine of the mapped K/V (higher: repair first)"
    )
    residual_cosine: list[float] = Field(default_factory=list, description="held-out cosine of mapped hidden states")
    residual_identity_cosine: list[float | None] = Field(
        default_factory=list, description="the same with the source hidden state unchanged"
    )
    residual_r2: list[float] = Field(default_factory=list, description="held-out R2 of mapped hidden states")
    residual_alpha: list[float] = Field(default_factory=list, description="chosen ridge strength per layer")
    residual_tokens: int = Field(default=0, description="calibration tokens the residual maps were fitted on")
    residual_seconds: float = Field(default=0.0, description="wall time of the residual fit")
    blocks: dict[str, list[list[int]]] = Field(
        default_factory=dict,
        description="layer blocks [start, stop) the planner picks per budget spent on layers (key: layer budget)",
    )


class MappingManifest(_Model):
    """Everything about a saved mapping except its tensors."""

    mapping_version: int = Field(default=MAPPING_VERSION, description="format version of the mapping")
    created_at: str = Field(description="UTC time of creation, ISO 8601")
    source: ModelInfo
    target: ModelInfo
    method: MethodSpec
    layer_plan: list[LayerPlanEntry]
    calibration: CalibrationInfo
    metrics: list[LayerMetrics] = Field(default_factory=list)
    heldout: dict[str, float | None] = Field(default_factory=dict, description="held-out KL summary")
    pair_differences: list[str] = Field(default_factory=list, description="bridged differences (pair card)")
    tensors: FileRecord
    stats: FileRecord | None = Field(default=None, description="calibration statistics (for refitting baselines)")
    repair: RepairInfo | None = Field(default=None, description="residual maps and repair planning data, if fitted")
    exact_layers: int = Field(
        default=0, ge=0, description="leading target layers whose K/V equal the source's exactly (the same weights "
        "below them, e.g. a LoRA adapter and its base): passed through unchanged, never fitted",
    )

    @model_validator(mode="after")
    def _exact_layers_pass_through(self) -> MappingManifest:
        plan = {e.target_layer: e for e in self.layer_plan}
        for i in range(self.exact_layers):
            entry = plan.get(i)
            if entry is None or entry.mode != "passthrough" or entry.sources != [i]:
                raise ValueError(f"exact layer {i} is not a pass-through of source layer {i}")
        return self

    def cache_key(self) -> dict[str, object]:
        """Fields that must all match before KV mapped with this mapping may be reused (seed §5.3)."""
        return {
            "source_fingerprint": self.source.fingerprint["combined"],
            "target_fingerprint": self.target.fingerprint["combined"],
            "source_rope": self.source.rope,
            "target_rope": self.target.rope,
            "source_dtype": self.source.dtype,
            "runtime_dtype": self.target.dtype,
            "mapping_version": self.mapping_version,
            "method": self.method.name,
            "mapping_sha256": self.tensors.sha256,
        }

    def cache_key_digest(self) -> str:
        """sha256 of :meth:`cache_key` (canonical JSON)."""
        payload = json.dumps(self.cache_key(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(payload.encode()).hexdigest()
