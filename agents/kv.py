"""Model and KV-cache plumbing shared by prefill and generation (transformers 4.x and 5.x, CPU and CUDA).

transformers 5 renamed the forward keyword ``past_key_values`` to ``cache`` (and the output field
likewise); `forward_cache_kwarg` picks the one the model's forward accepts. Positions are always
passed explicitly, so a copied or mapped cache is continued at exactly the right offset.
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from agents.errors import ContextOverflowError, PrefixCacheMismatchError

__all__ = [
    "Prefill",
    "forward_cache_kwarg",
    "new_cache",
    "cache_length",
    "cache_tensors",
    "copy_cache",
    "model_device",
    "max_positions",
    "check_context",
    "check_prefix_cache",
    "forward_tokens",
    "prefill_document",
    "sync_device",
]


@cache
def _forward_params(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def forward_cache_kwarg(model: Any) -> str:
    """'cache' (transformers 5.x) or 'past_key_values' (4.x), whichever the model's forward accepts."""
    params = _forward_params(type(model))
    return "cache" if "cache" in params else "past_key_values"


def _logits_kwargs(model: Any) -> dict[str, int]:
    params = _forward_params(type(model))
    if "logits_to_keep" in params:
        return {"logits_to_keep": 1}
    if "num_logits_to_keep" in params:
        return {"num_logits_to_keep": 1}
    return {}


def new_cache(model: Any) -> Any:
    """An empty DynamicCache configured for ``model``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [batch, kv_heads, seq, head_dim]."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers if getattr(layer, "keys", None) is not None]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def cache_length(cache: Any) -> int:
    """Number of token positions held in the cache."""
    return int(cache.get_seq_length())


def model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def _model_dtype(model: Any) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def _clone_cache(cache: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Copy the cache's structure shallowly and its tensors deeply (much faster than copy.deepcopy)."""
    def clone(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype, copy=True)

    fresh = copy.copy(cache)
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers 5.x: one layer object per decoder layer
        fresh.layers = []
        for layer in layers:
            twin = copy.copy(layer)
            for name, value in vars(layer).items():  # keys, values and any other state tensors
                if isinstance(value, torch.Tensor):
                    setattr(twin, name, clone(value) if name in ("keys", "values") else value.clone())
            if hasattr(twin, "device") and isinstance(getattr(layer, "keys", None), torch.Tensor):
                twin.device = device
            fresh.layers.append(twin)
        return fresh
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):  # transformers 4.x
        fresh.key_cache = [clone(k) for k in cache.key_cache]
        fresh.value_cache = [clone(v) for v in cache.value_cache]
        return fresh
    return None


def copy_cache(cache: Any, model: Any) -> Any:
    """A private copy of ``cache`` on the model's device and dtype; ``cache`` itself is never modified."""
    device, dtype = model_device(model), _model_dtype(model)
    fresh = _clone_cache(cache, device, dtype)
    if fresh is not None:
        return fresh
    fresh = copy.deepcopy(cache)  # an unknown cache class: copy everything
    if any(k.device != device or k.dtype != dtype for k, _ in cache_tensors(fresh)):
        raise TypeError(f"cannot move a {type(cache).__name__} to {device}/{dtype}; pass a DynamicCache")
    return fresh


def max_positions(model: Any) -> int | None:
    """The model's maximum number of positions (from its config), or None if it declares none."""
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def check_context(model: Any, prefix_tokens: int, suffix_tokens: int = 0, max_new_tokens: int = 0,
                  *, agent: str | None = None) -> None:
    """Raise ContextOverflowError if prefix + suffix + max_new_tokens exceed the model's max positions.

    ``model`` may also be the limit itself (an int), to check before a model is loaded.
    """
    limit = model if isinstance(model, int) else max_positions(model)
    if limit is not None and prefix_tokens + suffix_tokens + max_new_tokens > limit:
        raise ContextOverflowError(limit=limit, prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens,
                                   max_new_tokens=max_new_tokens, agent=agent)


def check_prefix_cache(cache: Any, prefix_tokens: int) -> None:
    """Raise PrefixCacheMismatchError unless the cache holds exactly ``prefix_tokens`` positions."""
    held = cache_length(cache)
    if held != prefix_tokens:
        raise PrefixCacheMismatchError(held, prefix_tokens)


def forward_tokens(model: Any, ids: torch.Tensor | list[int], cache: Any, start: int) -> torch.Tensor:
    """Run ``ids`` at positions ``start...`` through the model, extending ``cache`` in place.

    Returns the logits of the last position, shape [vocab], float32.
    """
    device = model_device(model)
    input_ids = torch.as_tensor(ids, dtype=torch.long, device=device).view(1, -1)
    positions = torch.arange(start, start + input_ids.shape[1], device=device).unsqueeze(0)
    kwargs = {forward_cache_kwarg(model): cache, **_logits_kwargs(model)}
    out = model(input_ids=input_ids, position_ids=positions, use_cache=True, **kwargs)
    return out.logits[0, -1].float()


@dataclass
class Prefill:
    """A full prefill: the cache holding every prefix position, the last position's logits, seconds."""

    cache: Any
    seconds: float
    tokens: int
    last_logits: torch.Tensor


def sync_device(device: torch.device) -> None:
    """Wait for queued CUDA work on ``device`` (so timings are real); no-op elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_document(model: Any, prefix_ids: list[int] | torch.Tensor, *, chunk_size: int | None = None) -> Prefill:
    """Prefill ``prefix_ids`` on ``model`` from scratch and return the cache and the time it took.

    ``chunk_size`` bounds peak memory on long documents (None: one forward pass).
    Raises ContextOverflowError if the ids do not fit in the model's maximum positions.
    """
    ids = torch.as_tensor(prefix_ids, dtype=torch.long).view(-1)
    if ids.numel() == 0:
        raise ValueError("prefill_document needs at least one token")
    check_context(model, ids.numel())
    device = model_device(model)
    cache = new_cache(model)
    step = ids.numel() if not chunk_size else max(1, chunk_size)
    with torch.no_grad():
        sync_device(device)
        t0 = time.perf_counter()
        for start in range(0, ids.numel(), step):
            logits = forward_tokens(model, ids[start : start + step], cache, start)
        sync_device(device)
        seconds = time.perf_counter() - t0
    return Prefill(cache=cache, seconds=seconds, tokens=int(ids.numel()), last_logits=logits)
