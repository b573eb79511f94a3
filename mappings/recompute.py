"""Recompute parts of a target cache exactly: a block of layers from a hidden state, or chosen tokens.

Layer block: run target decoder layers ``start..stop-1`` on a hidden state entering layer
``start`` (the target's own, or one mapped from the source) for every document token, exactly as
the target's own forward pass does (same RoPE, causal attention, same layer modules), and keep
the K/V they write. With the embeddings as input (``start == 0``) the block's K/V are the
target's own. The model is never mutated, so other threads may use it concurrently.

Tokens: recompute positions ``P`` exactly *given the cache before them*: for each contiguous run
of positions, forward its tokens over the cache cut at the run's start and write the K/V they
produce back in place. Later positions keep their mapped K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mappings.cache_io import (
    KVLayers,
    build_cache,
    cache_kwarg,
    cache_layers,
    forward_with_cache,
    model_device,
    slice_layers,
)
from mappings.capture import decoder_layers
from mappings.errors import ShapeMismatchError, UnsupportedModelError

if TYPE_CHECKING:
    import torch

__all__ = ["run_layers", "embed", "repair_tokens", "runs"]


def _base_model(model: Any) -> Any:
    base = getattr(model, "model", None)
    if base is not None and hasattr(base, "layers"):
        return base
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    raise UnsupportedModelError(f"cannot find the decoder stack of {type(model).__name__}")


def embed(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """The hidden state entering layer 0: the target's token embeddings."""
    import torch

    with torch.no_grad():
        return model.get_input_embeddings()(input_ids.to(model_device(model)))


def _causal_mask(model: Any, n: int, dtype: torch.dtype, device: Any) -> torch.Tensor | None:
    import torch

    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if "flash" in impl:  # flash kernels take no dense mask; they are causal by construction
        return None
    mask = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=device).triu_(1)
    return mask[None, None]


def run_layers(
    model: Any, hidden: torch.Tensor, start: int, stop: int, *, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, KVLayers]:
    """Run decoder layers ``start..stop-1`` on ``hidden`` ``[batch, n, d]`` (the input of ``start``).

    Returns ``(hidden leaving layer stop-1, [(K, V) for each layer in the block])``. Positions are
    ``0..n-1`` unless given; every token attends causally to all earlier ones in the block.
    """
    import torch

    layers = decoder_layers(model)
    if not 0 <= start < stop <= len(layers):
        raise ShapeMismatchError(f"layer block {start}..{stop - 1} is outside the model's {len(layers)} layers")
    base = _base_model(model)
    dev = model_device(model)
    h = hidden.to(dev)
    b, n, _ = h.shape
    if positions is None:
        positions = torch.arange(n, device=dev)[None].expand(b, -1)
    positions = positions.to(dev)
    cache = build_cache([], config=model.config)  # empty; the block's layers write their K/V into it
    kw = cache_kwarg(layers[start])
    with torch.no_grad():
        pos_emb = base.rotary_emb(h, positions) if hasattr(base, "rotary_emb") else None
        mask = _causal_mask(model, n, h.dtype, dev)
        for i in range(start, stop):
            out = layers[i](h, attention_mask=mask, position_ids=positions, use_cache=True,
                            position_embeddings=pos_emb, **{kw: cache})
            h = out[0] if isinstance(out, tuple) else out
    kv = _layers_from(cache, start, stop)
    return h, kv


def _layers_from(cache: Any, start: int, stop: int) -> KVLayers:
    out: KVLayers = []
    if hasattr(cache, "layers"):
        for i in range(start, stop):
            layer = cache.layers[i]
            out.append((layer.keys, layer.values))
        return out
    return [(cache.key_cache[i], cache.value_cache[i]) for i in range(start, stop)]  # transformers 4.x


def runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` runs of sorted, distinct positions."""
    out: list[tuple[int, int]] = []
    for p in sorted(set(int(p) for p in positions)):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def repair_tokens(model: Any, layers: KVLayers, input_ids: torch.Tensor, positions: Sequence[int]) -> KVLayers:
    """``layers`` with the K/V at ``positions`` recomputed on ``model`` given the cache before them.

    ``layers`` covers ``input_ids`` ``[batch, n]``. Each repaired token sees the other repaired
    tokens before it as recomputed and every other earlier position as given, as if the runs were
    processed left to right. All positions go through one forward pass with an explicit mask
    (flash-attention models, which take no dense mask, are run run by run instead). Cost: the
    repaired tokens attending to their prefix, about ``len(positions) / n`` of a prefill.
    """
    import torch

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    n = input_ids.shape[1]
    if int(layers[0][0].shape[-2]) != n:
        raise ShapeMismatchError(f"the cache holds {int(layers[0][0].shape[-2])} positions, input_ids {n}")
    pos = sorted({int(p) for p in positions})
    if not pos:
        return list(layers)
    if pos[0] < 0 or pos[-1] >= n:
        raise ShapeMismatchError(f"token positions {pos[0]}..{pos[-1]} are outside the {n}-token prefix")
    if "flash" in (getattr(model.config, "_attn_implementation", None) or ""):
        return _repair_runs(model, layers, input_ids, pos)
    dev = model_device(model)
    p = torch.tensor(pos, device=dev)
    dtype = layers[0][0].dtype
    # The cache keeps all n positions; the repaired tokens are appended after them and scattered back.
    cache = build_cache(layers, config=model.config)
    old = torch.arange(n, device=dev)
    see_old = (old[None, :] < p[:, None]) & ~torch.isin(old, p)[None, :]
    see_new = p[None, :] <= p[:, None]
    allowed = torch.cat([see_old, see_new], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, torch.finfo(dtype).min)
    b = input_ids.shape[0]
    _, cache, _ = forward_with_cache(model, input_ids[:, p.cpu()], cache, position_ids=p[None].expand(b, -1),
                                     attention_mask=mask[None, None].expand(b, 1, -1, -1), logits_to_keep=1)
    out: KVLayers = []
    for (k, v), (nk, nv) in zip(layers, cache_layers(cache), strict=True):
        k, v = k.clone(), v.clone()
        k[:, :, p] = nk[:, :, n:].to(k.dtype)
        v[:, :, p] = nv[:, :, n:].to(v.dtype)
        out.append((k, v))
    return out


def _repair_runs(model: Any, layers: KVLayers, input_ids: torch.Tensor, pos: Sequence[int]) -> KVLayers:
    import torch

    out = [(k.clone(), v.clone()) for k, v in layers]
    for a, z in runs(pos):
        prefix = build_cache(slice_layers(out, 0, a), config=model.config) if a else None
        _, cache, _ = forward_with_cache(model, input_ids[:, a:z], prefix, logits_to_keep=1)
        with torch.no_grad():
            for (k, v), (nk, nv) in zip(out, slice_layers(cache_layers(cache), a, z), strict=True):
                k[..., a:z, :] = nk.to(k.dtype)
                v[..., a:z, :] = nv.to(v.dtype)
    return out
