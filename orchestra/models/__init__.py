"""Models and references: what a member is, where its weights come from, and how it is loaded.

Owns model references (a local folder or a Hub id, an adapter over a declared model, a quantized
view of one), the registry that resolves a family's aliases and loads each member once on its
device, LoRA layers applied at run time and torchao quantization at load time, and the digest that
identifies a folder's weights.

May import: ``orchestra.errors``, ``orchestra.paths``, ``mappings`` and libraries. Nothing in
``orchestra`` above it (the cache, pipelines, runs, the server) is imported from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestra._exports import lazy_exports

if TYPE_CHECKING:
    from orchestra.models.fpcache import folder_weights_digest, weights_stamp
    from orchestra.models.lora import LoraLayout, LoraModule, attach_lora
    from orchestra.models.modelref import (
        AdapterSpec,
        ModelRef,
        QuantizeSpec,
        ResolvedAdapter,
        ResolvedModel,
        hub_cache_dir,
        hub_offline,
        is_adapter_folder,
    )
    from orchestra.models.quantize import quantize_decoder, quiet_torchao_import
    from orchestra.models.registry import (
        AdapterLineage,
        LoadedModel,
        ModelInfo,
        ModelRegistry,
        QuantizedLineage,
        pick_device,
        resolve_dtype,
    )

__all__ = [
    "ModelRef",
    "ResolvedModel",
    "AdapterSpec",
    "ResolvedAdapter",
    "QuantizeSpec",
    "hub_cache_dir",
    "hub_offline",
    "is_adapter_folder",
    "ModelRegistry",
    "ModelInfo",
    "LoadedModel",
    "AdapterLineage",
    "QuantizedLineage",
    "pick_device",
    "resolve_dtype",
    "LoraModule",
    "LoraLayout",
    "attach_lora",
    "quantize_decoder",
    "quiet_torchao_import",
    "folder_weights_digest",
    "weights_stamp",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "orchestra.models.fpcache": (
            "folder_weights_digest",
            "weights_stamp",
        ),
        "orchestra.models.lora": (
            "LoraLayout",
            "LoraModule",
            "attach_lora",
        ),
        "orchestra.models.modelref": (
            "AdapterSpec",
            "ModelRef",
            "QuantizeSpec",
            "ResolvedAdapter",
            "ResolvedModel",
            "hub_cache_dir",
            "hub_offline",
            "is_adapter_folder",
        ),
        "orchestra.models.quantize": (
            "quantize_decoder",
            "quiet_torchao_import",
        ),
        "orchestra.models.registry": (
            "AdapterLineage",
            "LoadedModel",
            "ModelInfo",
            "ModelRegistry",
            "QuantizedLineage",
            "pick_device",
            "resolve_dtype",
        ),
    },
)
