"""Read per-layer K/V out of any cache form and build caches a target model accepts.

Supported cache forms:

- ``DynamicCache`` with ``.layers[i].keys/.values`` (transformers 4.56+ and 5.x);
- older ``DynamicCache`` with ``.key_cache`` / ``.value_cache`` lists;
- legacy tuples ``((k0, v0), (k1, v1), ...)``.

Every tensor is ``[batch, kv_heads, seq, head_dim]``. Models take the cache as ``cache=``
(transformers 5) or ``past_key_values=`` (transformers 4): :func:`cache_kwarg` finds out which.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from mappings.errors import ShapeMismatchError, UnsupportedModelError

if TYPE_CHECKING:
    import torch

__all__ = [
    "KVLayers",
    "cache_layers",
    "build_cache",
    "cache_kwarg",
    "cache_length",
    "forward_with_cache",
    "prefill",
    "slice_layers",
    "model_device",
    "model_dtype",
]

KVLayers = list[tuple["torch.Tensor", "torch.Tensor"]]
"""Per-layer ``(keys, values)``, each ``[batch, kv_heads, seq, head_dim]``."""


def cache_layers(cache: Any) -> KVLayers:
    """Per-layer ``(K, V)`` of a cache in any supported form (tensors are not copied)."""
    if cache is None:
        raise ShapeMismatchError("no cache given: run the model with use_cache=True first")
    layers = getattr(cache, "layers", None)
    if layers is not None and not isinstance(cache, (tuple, list)):
        out: KVLayers = []
        for i, layer in enumerate(layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or keys.numel() == 0:
                raise ShapeMismatchError(
                    f"cache layer {i} ({type(layer).__name__}) holds no keys/values; "
                    "fill the cache with a prefill before reading it"
                )
            out.append((keys, values))
        return out
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    if isinstance(cache, (tuple, list)):
        out = []
        for i, item in enumerate(cache):
            if not isinstance(item, (tuple, list)) or len(item) < 2:
                raise ShapeMismatchError(f"legacy cache entry {i} is not a (key, value) pair")
            out.append((item[0], item[1]))
        return out
    raise UnsupportedModelError(
        f"cannot read keys/values from a {type(cache).__name__}; pass a DynamicCache or legacy tuples"
    )


def cache_length(cache: Any) -> int:
    """Number of cached positions."""
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    layers = cache_layers(cache)
    return int(layers[0][0].shape[-2]) if layers else 0


def slice_layers(layers: KVLayers, start: int = 0, stop: int | None = None) -> KVLayers:
    """The ``[start, stop)`` positions of every layer (views, no copy)."""
    return [(k[:, :, start:stop], v[:, :, start:stop]) for k, v in layers]


def build_cache(
    layers: KVLayers, config: Any = None, device: Any = None, dtype: Any = None
) -> Any:
    """A fresh ``DynamicCache`` holding ``layers``, on ``device``/``dtype`` when given.

    With ``config`` the cache gets the model's own layer types (e.g. sliding-window layers).
    Plain full-attention layers take the tensors as they are (no copy; caches never modify
    their tensors in place); other layer types are filled through ``update``.
    """
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:  # older transformers without config support
        cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        k = k.to(device=device if device is not None else k.device, dtype=dtype if dtype is not None else k.dtype)
        v = v.to(device=device if device is not None else v.device, dtype=dtype if dtype is not None else v.dtype)
        if not _adopt(cache, i, k, v):
            cache.update(k, v, i)
    return cache


def _adopt(cache: Any, index: int, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Hand ``k``/``v`` to an empty full-attention ``DynamicLayer`` without the copy ``update`` makes."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # transformers without per-layer cache objects
        return False
    layers = getattr(cache, "layers", None)
    if layers is None or index >= len(layers):
        return False
    layer = layers[index]
    if type(layer) is not DynamicLayer or getattr(layer, "is_initialized", True):
        return False
    layer.lazy_initialization(k, v)
    layer.keys, layer.values = k, v
    return True


def cache_kwarg(model: Any) -> str:
    """``"cache"`` when the model's forward takes ``cache=`` (transformers 5), else ``"past_key_values"``."""
    cached = getattr(model, "_mappings_cache_kwarg", None)
    if cached:
        return cached
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    try:
        model._mappings_cache_kwarg = name
    except AttributeError:  # pragma: no cover - exotic wrappers
        pass
    return name


def _accepts(model: Any, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def _output_cache(out: Any) -> Any:
    keys = set(out.keys()) if hasattr(out, "keys") else set()
    for name in ("cache", "past_key_values"):
        if name in keys and out[name] is not None:
            return out[name]
    return getattr(out, "cache", None)


def model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def model_dtype(model: Any) -> torch.dtype:
    import torch

    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def forward_with_cache(
    model: Any,
    input_ids: torch.Tensor,
    cache: Any = None,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    output_hidden_states: bool = False,
    logits_to_keep: int | None = None,
) -> tuple[torch.Tensor, Any, Any]:
    """Run ``input_ids`` after ``cache`` (None: from scratch); returns ``(logits, cache, outputs)``.

    Positions continue after the cached prefix unless ``position_ids`` is given. An
    ``attention_mask``, when given, covers prefix plus new tokens (``[batch, past + new]``); a 4-D
    mask (``[batch, 1, new, past + new]``, additive) goes to the model as it is, with ``position_ids``.
    A fresh full-length ``DynamicCache`` is used when ``cache`` is None so every layer keeps all
    positions.
    """
    import torch

    device = model_device(model)
    input_ids = input_ids.to(device)
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache()
    elif isinstance(cache, (tuple, list)):  # legacy tuples: models of transformers 5 want a Cache object
        cache = build_cache(cache_layers(cache))
    past = cache_length(cache)
    if position_ids is None:
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, past:]
        else:
            position_ids = torch.arange(past, past + input_ids.shape[1], device=device)[None].expand(
                input_ids.shape[0], -1
            )
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": position_ids.to(device),
        "use_cache": True,
        cache_kwarg(model): cache,
    }
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask.to(device)
    if output_hidden_states:
        kwargs["output_hidden_states"] = True
    if logits_to_keep is not None and _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = logits_to_keep
    with torch.no_grad():
        out = model(**kwargs)
    new_cache = _output_cache(out)
    return out.logits, (new_cache if new_cache is not None else cache), out


def prefill(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, Any]:
    """Prefill ``input_ids`` from scratch; returns ``(logits, cache)``."""
    logits, cache, _ = forward_with_cache(model, input_ids, None, attention_mask=attention_mask)
    return logits, cache
