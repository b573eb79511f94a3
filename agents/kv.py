"""Agent-side KV-cache helpers: context limits, the prefix-cache check, token forwards, document prefill.

The Hugging Face glue itself (cache objects, the forward keyword ``cache`` vs
``past_key_values``, device and dtype, copying, CUDA sync) lives in :mod:`mappings.cache_io`, the
project's one glue module, and is re-exported here under the names agents has always exported
(``forward_cache_kwarg`` is ``cache_kwarg``, ``cache_tensors`` is ``cache_layers``). Positions are
always passed explicitly, so a copied or mapped cache is continued at exactly the right offset.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agents.errors import ContextOverflowError, PrefixCacheMismatchError

if TYPE_CHECKING:
    from mappings.types import CacheLike, KVCache, Model
from mappings.cache_io import (
    cache_kwarg,
    cache_layers,
    cache_length,
    copy_cache,
    forward_with_cache,
    model_device,
    new_cache,
    sync_device,
)

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

forward_cache_kwarg = cache_kwarg
"""'cache' (transformers 5.x) or 'past_key_values' (4.x): :func:`mappings.cache_io.cache_kwarg`."""

cache_tensors = cache_layers
"""(keys, values) per layer, each [batch, kv_heads, seq, head_dim]: :func:`mappings.cache_io.cache_layers`."""


def max_positions(model: Model) -> int | None:
    """The model's maximum number of positions (from its config), or None if it declares none."""
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def check_context(model: Model | int, prefix_tokens: int, suffix_tokens: int = 0, max_new_tokens: int = 0,
                  *, agent: str | None = None) -> None:
    """Raise ContextOverflowError if prefix + suffix + max_new_tokens exceed the model's max positions.

    ``model`` may also be the limit itself (an int), to check before a model is loaded.
    """
    limit = model if isinstance(model, int) else max_positions(model)
    if limit is not None and prefix_tokens + suffix_tokens + max_new_tokens > limit:
        raise ContextOverflowError(limit=limit, prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens,
                                   max_new_tokens=max_new_tokens, agent=agent)


def check_prefix_cache(cache: CacheLike, prefix_tokens: int) -> None:
    """Raise PrefixCacheMismatchError unless the cache holds exactly ``prefix_tokens`` positions."""
    held = cache_length(cache)
    if held != prefix_tokens:
        raise PrefixCacheMismatchError(held, prefix_tokens)


def forward_tokens(model: Model, ids: torch.Tensor | list[int], cache: CacheLike, start: int) -> torch.Tensor:
    """Run ``ids`` at positions ``start...`` through the model, extending ``cache`` in place.

    Returns the logits of the last position, shape [vocab], float32 (only that position's logits
    are computed where the model allows it: decoding needs nothing else).
    """
    device = model_device(model)
    input_ids = torch.as_tensor(ids, dtype=torch.long, device=device).view(1, -1)
    positions = torch.arange(start, start + input_ids.shape[1], device=device).unsqueeze(0)
    logits, _, _ = forward_with_cache(model, input_ids, cache, position_ids=positions, logits_to_keep=1)
    return logits[0, -1].float()


@dataclass
class Prefill:
    """A full prefill: the cache holding every prefix position, the last position's logits, seconds."""

    cache: KVCache
    seconds: float
    tokens: int
    last_logits: torch.Tensor


def prefill_document(model: Model, prefix_ids: list[int] | torch.Tensor, *, chunk_size: int | None = None) -> Prefill:
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
