"""Closed-form cross-model KV maps: capture, fit, apply, store, evaluate.

Carry one model's prefilled KV cache into a same-family sibling with a per-layer linear map
fitted in closed form, and measure how close that brings the sibling to its own prefill.

    from mappings import calibrate, load_mapping, map_cache
    mapping = calibrate("family/root", "family/finetuned", [text_a, text_b])
    mapping.save("maps/root-to-finetuned")
    cache = map_cache(mapping.kv_map, source_cache, target_model)

Importing this package is cheap: torch and transformers load on first use of a name below.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__all__ = [
    # errors
    "MappingError",
    "TokenizerMismatchError",
    "ShapeMismatchError",
    "NonFiniteKVError",
    "CorpusTooSmallError",
    "DocumentTooLongError",
    "DocumentTooShortError",
    "StaleMappingError",
    "CorruptMappingError",
    "UnsupportedModelError",
    # fingerprints and models
    "Fingerprint",
    "fingerprint_model",
    "fingerprint_dir",
    "ModelHandle",
    "load_model",
    # caches and capture
    "KVLayers",
    "cache_layers",
    "build_cache",
    "forward_with_cache",
    "prefill",
    "KVShape",
    "kv_shape",
    "KVCapture",
    "capture_kv",
    "capture_texts",
    "capture_windows",
    "make_windows",
    # RoPE and pair compatibility
    "RopeSpec",
    "PairCard",
    "ModelCard",
    "check_pair",
    # fitting
    "RegressionStats",
    "fit_linear",
    "MethodSpec",
    "METHODS",
    "resolve_method",
    "fit_kv_map",
    # applying
    "LayerMap",
    "LinearKVMap",
    "map_cache",
    "tail_recompute",
    "identity_map",
    # artifacts
    "MAPPING_VERSION",
    "MappingManifest",
    "Mapping",
    "LayerStats",
    "save_mapping",
    "load_mapping",
    "read_manifest",
    # calibration and evaluation
    "CalibrationConfig",
    "calibrate",
    "EvaluationReport",
    "MethodResult",
    "evaluate",
    "write_report",
    "plot_layer_curves",
    # map, then repair
    "RepairPolicy",
    "RepairPlan",
    "RepairResult",
    "RepairUnavailableError",
    "plan_repair",
    "repair_cache",
    "attention_importance",
    "run_layers",
    "repair_tokens",
    "ResidualMap",
    "fit_residual_maps",
    "add_residual_maps",
]

_WHERE = {
    "mappings.errors": [
        "MappingError", "TokenizerMismatchError", "ShapeMismatchError", "NonFiniteKVError", "CorpusTooSmallError",
        "DocumentTooLongError", "DocumentTooShortError", "StaleMappingError", "CorruptMappingError",
        "UnsupportedModelError",
    ],
    "mappings.fingerprint": ["Fingerprint", "fingerprint_model", "fingerprint_dir"],
    "mappings.models": ["ModelHandle", "load_model"],
    "mappings.cache_io": ["KVLayers", "cache_layers", "build_cache", "forward_with_cache", "prefill"],
    "mappings.capture": ["KVShape", "kv_shape", "KVCapture", "capture_kv", "capture_texts", "capture_windows",
                         "make_windows"],
    "mappings.rope": ["RopeSpec"],
    "mappings.compat": ["PairCard", "ModelCard", "check_pair"],
    "mappings.fit": ["RegressionStats", "fit_linear"],
    "mappings.methods": ["MethodSpec", "METHODS", "resolve_method"],
    "mappings.assemble": ["fit_kv_map"],
    "mappings.apply": ["LayerMap", "LinearKVMap", "map_cache", "tail_recompute", "identity_map"],
    "mappings.manifest": ["MAPPING_VERSION", "MappingManifest"],
    "mappings.store": ["Mapping", "LayerStats", "save_mapping", "load_mapping", "read_manifest"],
    "mappings.calibrate": ["CalibrationConfig", "calibrate"],
    "mappings.evaluate": ["EvaluationReport", "MethodResult", "evaluate", "write_report", "plot_layer_curves"],
    "mappings.repair": ["RepairPolicy", "RepairPlan", "RepairResult", "RepairUnavailableError", "plan_repair",
                        "repair_cache", "attention_importance"],
    "mappings.recompute": ["run_layers", "repair_tokens"],
    "mappings.residual": ["ResidualMap", "fit_residual_maps", "add_residual_maps"],
}
_LAZY = {name: module for module, names in _WHERE.items() for name in names}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from mappings.apply import LayerMap, LinearKVMap, identity_map, map_cache, tail_recompute
    from mappings.assemble import fit_kv_map
    from mappings.cache_io import KVLayers, build_cache, cache_layers, forward_with_cache, prefill
    from mappings.calibrate import CalibrationConfig, calibrate
    from mappings.capture import (
        KVCapture,
        KVShape,
        capture_kv,
        capture_texts,
        capture_windows,
        kv_shape,
        make_windows,
    )
    from mappings.compat import ModelCard, PairCard, check_pair
    from mappings.errors import (
        CorpusTooSmallError,
        CorruptMappingError,
        DocumentTooLongError,
        DocumentTooShortError,
        MappingError,
        NonFiniteKVError,
        ShapeMismatchError,
        StaleMappingError,
        TokenizerMismatchError,
        UnsupportedModelError,
    )
    from mappings.evaluate import EvaluationReport, MethodResult, evaluate, plot_layer_curves, write_report
    from mappings.fingerprint import Fingerprint, fingerprint_dir, fingerprint_model
    from mappings.fit import RegressionStats, fit_linear
    from mappings.manifest import MAPPING_VERSION, MappingManifest
    from mappings.methods import METHODS, MethodSpec, resolve_method
    from mappings.models import ModelHandle, load_model
    from mappings.recompute import repair_tokens, run_layers
    from mappings.repair import (
        RepairPlan,
        RepairPolicy,
        RepairResult,
        RepairUnavailableError,
        attention_importance,
        plan_repair,
        repair_cache,
    )
    from mappings.residual import ResidualMap, add_residual_maps, fit_residual_maps
    from mappings.rope import RopeSpec
    from mappings.store import LayerStats, Mapping, load_mapping, read_manifest, save_mapping


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mappings' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
