"""Drop decoder layers from a causal LM (the first step of the smaller, distilled member)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def drop_layers(model: PreTrainedModel, drop: list[int]) -> PreTrainedModel:
    """Remove the given decoder layers in place and fix indices and config."""
    layers = model.model.layers
    n = len(layers)
    bad = [i for i in drop if not 0 <= i < n]
    if bad:
        raise ValueError(f"cannot drop layers {bad}: the model has {n} layers")
    keep = [i for i in range(n) if i not in set(drop)]
    model.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
    for new_idx, layer in enumerate(model.model.layers):
        # Cache updates are routed by this index: stale values would write into wrong slots.
        if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = new_idx
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    return model
