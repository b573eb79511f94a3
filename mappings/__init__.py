"""Closed-form cross-model KV maps: capture, fit, apply, store, evaluate.

Carry one model's prefilled KV cache into a same-family sibling with a per-layer linear map
fitted in closed form, and measure how close that brings the sibling to its own prefill.

    from mappings import CalibrationSettings, calibrate, load_mapping, map_cache
    mapping = calibrate("family/root", "family/finetuned", [text_a, text_b], CalibrationSettings(tokens=4096))
    mapping.save("maps/root-to-finetuned")
    cache = map_cache(mapping.kv_map, source_cache, target_model)

Importing this package is cheap: torch and transformers load on first use of a name below.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

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
    "check_fingerprints",
    "ModelHandle",
    "load_model",
    # caches and capture
    "KVLayers",
    "cache_layers",
    "build_cache",
    "cache_kwarg",
    "cache_length",
    "slice_layers",
    "truncate_cache",
    "copy_cache",
    "new_cache",
    "forward_with_cache",
    "prefill",
    "model_device",
    "model_dtype",
    "sync_device",
    "ForwardOutputs",
    "KVShape",
    "kv_shape",
    "KVCapture",
    "capture_kv",
    "capture_texts",
    "capture_windows",
    "capture_queries",
    "make_windows",
    # RoPE and pair compatibility
    "RopeSpec",
    "PairCard",
    "ModelCard",
    "check_pair",
    "TokenizerDiff",
    "compare_tokenizers",
    # fitting
    "RegressionStats",
    "LayerStats",
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
    "save_mapping",
    "load_mapping",
    "read_manifest",
    # calibration and evaluation
    "CalibrationSettings",
    "CalibrationConfig",
    "calibrate",
    "mean_kl",
    "tail_nll",
    "EvaluationSettings",
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
    "layer_scores",
    "choose_blocks",
    "repair_cache",
    "attention_importance",
    "run_layers",
    "repair_tokens",
    "ResidualMap",
    "fit_residual_maps",
    "add_residual_maps",
    # type aliases (for annotations)
    "Tensor",
    "Device",
    "DeviceLike",
    "DType",
    "Module",
    "Model",
    "ModelConfig",
    "Tokenizer",
    "KVCache",
    "LegacyCache",
    "CacheLike",
    "JSONScalar",
    "JSONValue",
    "JSONDict",
]

_WHERE = {
    "mappings.errors": [
        "MappingError", "TokenizerMismatchError", "ShapeMismatchError", "NonFiniteKVError", "CorpusTooSmallError",
        "DocumentTooLongError", "DocumentTooShortError", "StaleMappingError", "CorruptMappingError",
        "UnsupportedModelError",
    ],
    "mappings.fingerprint": ["Fingerprint", "fingerprint_model", "fingerprint_dir", "check_fingerprints"],
    "mappings.models": ["ModelHandle", "load_model"],
    "mappings.cache_io": ["KVLayers", "cache_layers", "build_cache", "cache_kwarg", "cache_length", "slice_layers",
                          "truncate_cache", "copy_cache", "new_cache", "forward_with_cache", "prefill",
                          "model_device", "model_dtype", "sync_device", "ForwardOutputs"],
    "mappings.capture": ["KVShape", "kv_shape", "KVCapture", "capture_kv", "capture_texts", "capture_windows",
                         "capture_queries", "make_windows"],
    "mappings.rope": ["RopeSpec"],
    "mappings.compat": ["PairCard", "ModelCard", "check_pair"],
    "mappings.tokenizer_compat": ["TokenizerDiff", "compare_tokenizers"],
    "mappings.fit": ["RegressionStats", "LayerStats", "fit_linear"],
    "mappings.methods": ["MethodSpec", "METHODS", "resolve_method"],
    "mappings.assemble": ["fit_kv_map"],
    "mappings.apply": ["LayerMap", "LinearKVMap", "map_cache", "tail_recompute", "identity_map"],
    "mappings.manifest": ["MAPPING_VERSION", "MappingManifest"],
    "mappings.store": ["Mapping", "save_mapping", "load_mapping", "read_manifest"],
    "mappings.calibrate": ["CalibrationSettings", "CalibrationConfig", "calibrate"],
    "mappings.metrics": ["mean_kl", "tail_nll"],
    "mappings.evaluate": ["EvaluationSettings", "EvaluationReport", "MethodResult", "evaluate", "write_report",
                          "plot_layer_curves"],
    "mappings.repair": ["RepairPolicy", "RepairPlan", "RepairResult", "RepairUnavailableError", "plan_repair",
                        "layer_scores", "choose_blocks", "repair_cache", "attention_importance"],
    "mappings.recompute": ["run_layers", "repair_tokens"],
    "mappings.residual": ["ResidualMap", "fit_residual_maps"],
    "mappings.calibrate_repair": ["add_residual_maps"],
    "mappings.types": ["Tensor", "Device", "DeviceLike", "DType", "Module", "Model", "ModelConfig", "Tokenizer",
                       "KVCache", "LegacyCache", "CacheLike", "JSONScalar", "JSONValue", "JSONDict"],
}
_LAZY = {name: module for module, names in _WHERE.items() for name in names}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from mappings.apply import LayerMap, LinearKVMap, identity_map, map_cache, tail_recompute
    from mappings.assemble import fit_kv_map
    from mappings.cache_io import (
        ForwardOutputs,
        KVLayers,
        build_cache,
        cache_kwarg,
        cache_layers,
        cache_length,
        copy_cache,
        forward_with_cache,
        model_device,
        model_dtype,
        new_cache,
        prefill,
        slice_layers,
        sync_device,
        truncate_cache,
    )
    from mappings.calibrate import CalibrationConfig, CalibrationSettings, calibrate
    from mappings.calibrate_repair import add_residual_maps
    from mappings.capture import (
        KVCapture,
        KVShape,
        capture_kv,
        capture_queries,
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
    from mappings.evaluate import (
        EvaluationReport,
        EvaluationSettings,
        MethodResult,
        evaluate,
        plot_layer_curves,
        write_report,
    )
    from mappings.fingerprint import Fingerprint, check_fingerprints, fingerprint_dir, fingerprint_model
    from mappings.fit import LayerStats, RegressionStats, fit_linear
    from mappings.manifest import MAPPING_VERSION, MappingManifest
    from mappings.methods import METHODS, MethodSpec, resolve_method
    from mappings.metrics import mean_kl, tail_nll
    from mappings.models import ModelHandle, load_model
    from mappings.recompute import repair_tokens, run_layers
    from mappings.repair import (
        RepairPlan,
        RepairPolicy,
        RepairResult,
        RepairUnavailableError,
        attention_importance,
        choose_blocks,
        layer_scores,
        plan_repair,
        repair_cache,
    )
    from mappings.residual import ResidualMap, fit_residual_maps
    from mappings.rope import RopeSpec
    from mappings.store import Mapping, load_mapping, read_manifest, save_mapping
    from mappings.tokenizer_compat import TokenizerDiff, compare_tokenizers
    from mappings.types import (
        CacheLike,
        Device,
        DeviceLike,
        DType,
        JSONDict,
        JSONScalar,
        JSONValue,
        KVCache,
        LegacyCache,
        Model,
        ModelConfig,
        Module,
        Tensor,
        Tokenizer,
    )


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mappings' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
