"""Recompute parts of a target cache exactly: a block of layers from a hidden state, or chosen tokens.

Layer block: run target decoder layers ``start..stop-1`` on a hidden state entering layer
``start`` (the target's own, or one mapped from the source) for every document token, exactly as
the target's own forward pass does (same RoPE, causal attention, same layer modules), and keep
the K/V they write. With the embeddings as input (``start == 0``) the block's K/V are the
target's own. The model is never mutated, so other threads may use it concurrently.

Tokens: recompute positions ``P`` exactly *given the cache before them*, as if their runs were
processed left to right: each repaired token sees the repaired tokens before it as recomputed and
every other earlier position as given. Later positions keep their given K/V. The trailing run (the
one ending at the last position) and a leading run (from position 0) are plain causal passes over
the cache cut at their start, the same kernel and cost per token as the model's own prefill; the
interior positions between them share one pass with an explicit mask. Every pass writes its K/V
straight into one fresh output tensor per layer, so the given cache is read once and never copied
twice (or modified).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache as _memoize
from typing import TYPE_CHECKING, cast

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

    from mappings.cache_io import _ListCache
    from mappings.types import DeviceLike, KVCache, Model, Module

__all__ = ["run_layers", "embed", "repair_tokens", "repair_tokens_and_logits", "token_passes", "runs"]


def _base_model(model: Model) -> Module:
    base = getattr(model, "model", None)
    if base is not None and hasattr(base, "layers"):
        return base
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    raise UnsupportedModelError(f"cannot find the decoder stack of {type(model).__name__}")


def embed(model: Model, input_ids: torch.Tensor) -> torch.Tensor:
    """The hidden state entering layer 0: the target's token embeddings."""
    import torch

    with torch.no_grad():
        return model.get_input_embeddings()(input_ids.to(model_device(model)))


def _causal_mask(model: Model, n: int, dtype: torch.dtype, device: DeviceLike) -> torch.Tensor | None:
    import torch

    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if "flash" in impl:  # flash kernels take no dense mask; they are causal by construction
        return None
    mask = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=device).triu_(1)
    return mask[None, None]


def run_layers(
    model: Model, hidden: torch.Tensor, start: int, stop: int, *, positions: torch.Tensor | None = None
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
        rotary = getattr(base, "rotary_emb", None)
        pos_emb = rotary(h, positions) if rotary is not None else None
        mask = _causal_mask(model, n, h.dtype, dev)
        for i in range(start, stop):
            out = layers[i](h, attention_mask=mask, position_ids=positions, use_cache=True,
                            position_embeddings=pos_emb, **{kw: cache})
            h = out[0] if isinstance(out, tuple) else out
    kv = _layers_from(cache, start, stop)
    return h, kv


def _layers_from(cache: KVCache, start: int, stop: int) -> KVLayers:
    out: KVLayers = []
    if hasattr(cache, "layers"):
        for i in range(start, stop):
            layer = cache.layers[i]
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None:
                raise UnsupportedModelError(f"cache layer {i} ({type(layer).__name__}) holds no keys/values")
            out.append((keys, values))
        return out
    legacy = cast("_ListCache", cache)  # transformers 4.x
    return [(legacy.key_cache[i], legacy.value_cache[i]) for i in range(start, stop)]


def runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` runs of sorted, distinct positions."""
    out: list[tuple[int, int]] = []
    for p in sorted(set(int(p) for p in positions)):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def token_passes(n: int, positions: Sequence[int], *, flash: bool = False) -> list[tuple[int, int]]:
    """The forward passes :func:`repair_tokens` makes for ``positions`` of an ``n``-token cache.

    One ``(queries, cached keys before them)`` pair per pass, in order: what its compute is made
    of (each query scores ``cached + queries`` keys). The leading run from position 0 and the
    trailing run ending at ``n - 1`` are causal passes over the cache cut at their start; the
    interior between them is one run's causal pass, or one masked pass over the cache cut after
    its last position (run by run for flash-attention models).
    """
    pos = sorted({int(p) for p in positions})
    if not pos:
        return []
    spans = runs(pos)
    tail = spans[-1] if spans[-1][1] == n else None
    head = spans[:-1] if tail is not None else spans
    out: list[tuple[int, int]] = []
    if head and head[0][0] == 0:
        out.append((head[0][1], 0))
        head = head[1:]
    if len(head) == 1 or (head and flash):
        out.extend((z - a, a) for a, z in head)
    elif head:
        out.append((sum(z - a for a, z in head), head[-1][1]))
    if tail is not None:
        out.append((tail[1] - tail[0], tail[0]))
    return out


def repair_tokens(model: Model, layers: KVLayers, input_ids: torch.Tensor, positions: Sequence[int]) -> KVLayers:
    """``layers`` with the K/V at ``positions`` recomputed on ``model`` given the cache before them.

    ``layers`` covers ``input_ids`` ``[batch, n]``. Each repaired token sees the other repaired
    tokens before it as recomputed and every other earlier position as given, as if the runs were
    processed left to right. The trailing and leading runs are plain causal passes; the interior
    positions share one masked pass (flash-attention models, which take no dense mask, run them
    run by run). Cost: ``len(positions)`` tokens through the model, each scoring the keys of its pass
    (a trailing token about ``n``, an average prefill token ``n / 2``); :func:`mappings.repair.compute_share`
    counts it as a share of a prefill. ``layers`` is never modified: the result is fresh tensors (``layers``' own when
    there is nothing to repair).
    """
    return repair_tokens_and_logits(model, layers, input_ids, positions)[0]


def repair_tokens_and_logits(
    model: Model, layers: KVLayers, input_ids: torch.Tensor, positions: Sequence[int], *, logits: int = 0,
    in_place: bool = False,
) -> tuple[KVLayers, torch.Tensor | None]:
    """:func:`repair_tokens`, also recomputing the last ``logits`` positions and returning their logits.

    The last ``logits`` positions join ``positions`` (their logits are only exact when they are
    recomputed), so a probe over the trailing tokens costs nothing beyond the repair when the
    repair's own tail covers it. Returns ``(layers, logits [batch, logits, vocab] or None)``.
    ``in_place`` writes into ``layers``' tensors instead of fresh ones: only for tensors the caller
    owns alone (a repair ladder's own working copy), never a cache someone else may read.
    """
    import torch

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    n = input_ids.shape[1]
    if int(layers[0][0].shape[-2]) != n:
        raise ShapeMismatchError(f"the cache holds {int(layers[0][0].shape[-2])} positions, input_ids {n}")
    if not 0 <= logits <= n:
        raise ShapeMismatchError(f"cannot keep the logits of {logits} positions of a {n}-token prefix")
    pos = sorted({int(p) for p in positions} | set(range(n - logits, n)))
    if not pos:
        return list(layers), None
    if pos[0] < 0 or pos[-1] >= n:
        raise ShapeMismatchError(f"token positions {pos[0]}..{pos[-1]} are outside the {n}-token prefix")
    spans = runs(pos)
    tail_start = spans[-1][0] if spans[-1][1] == n else n
    if in_place:
        out = list(layers)
    else:
        # The one copy: every position the repair keeps goes into a fresh tensor, which the passes then fill.
        out = []
        for k, v in layers:
            nk, nv = torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(
                v, memory_format=torch.contiguous_format)
            nk[..., :tail_start, :] = k[..., :tail_start, :]
            nv[..., :tail_start, :] = v[..., :tail_start, :]
            out.append((nk, nv))
    flash = "flash" in (getattr(model.config, "_attn_implementation", None) or "")
    head = [span for span in spans if span[0] < tail_start]
    if head and head[0][0] == 0:  # a leading run (attention sinks): a plain prefill of its tokens
        _continue(model, out, input_ids, 0, head[0][1])
        head = head[1:]
    if len(head) == 1 or (head and flash):
        for a, z in head:
            _continue(model, out, input_ids, a, z)
    elif head:
        _masked(model, out, input_ids, [p for a, z in head for p in range(a, z)])
    kept = None
    if tail_start < n:
        kept = _continue(model, out, input_ids, tail_start, n, keep=max(logits, 1))
        kept = kept[:, kept.shape[1] - logits :] if logits else None
    return out, kept


def _continue(model: Model, out: KVLayers, input_ids: torch.Tensor, a: int, z: int, keep: int = 1) -> torch.Tensor:
    """Forward tokens ``a..z-1`` causally over ``out``'s first ``a`` positions, writing their K/V into ``out``.

    Returns the logits of the last ``keep`` of them. Writes through a cache backed by ``out`` when
    the model's cache layers allow it (no copy at all); otherwise over a cut cache, copying the new
    positions back.
    """
    cache = _cache_into(model, out, a)
    if cache is not None:
        logits, _, _ = forward_with_cache(model, input_ids[:, a:z], cache, logits_to_keep=keep)
        return logits
    prefix = build_cache(slice_layers(out, 0, a), config=model.config) if a else None
    logits, cache, _ = forward_with_cache(model, input_ids[:, a:z], prefix, logits_to_keep=keep)
    for (k, v), (nk, nv) in zip(out, slice_layers(cache_layers(cache), a, z), strict=True):
        k[..., a:z, :] = nk
        v[..., a:z, :] = nv
    return logits


def _masked(model: Model, out: KVLayers, input_ids: torch.Tensor, pos: list[int]) -> None:
    """Recompute scattered ``pos`` (sorted) in one pass over ``out`` cut after the last, with a mask.

    Each token sees the cut cache except the positions being recomputed (their given K/V), plus
    the recomputed tokens up to itself: what left-to-right runs would give. The mask covers only
    ``last + 1 + k`` keys, not the whole document.
    """
    import torch

    dev = model_device(model)
    p = torch.tensor(pos, device=dev)
    c = pos[-1] + 1
    dtype = out[0][0].dtype
    old = torch.arange(c, device=dev)
    see_old = (old[None, :] < p[:, None]) & ~torch.isin(old, p)[None, :]
    see_new = p[None, :] <= p[:, None]
    allowed = torch.cat([see_old, see_new], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, torch.finfo(dtype).min)
    b = input_ids.shape[0]
    cache = build_cache(slice_layers(out, 0, c), config=model.config)
    _, cache, _ = forward_with_cache(model, input_ids[:, p.cpu()], cache, position_ids=p[None].expand(b, -1),
                                     attention_mask=mask[None, None].expand(b, 1, -1, -1), logits_to_keep=1)
    for (k, v), (nk, nv) in zip(out, cache_layers(cache), strict=True):
        k[:, :, p] = nk[:, :, c:].to(k.dtype)
        v[:, :, p] = nv[:, :, c:].to(v.dtype)


@_memoize
def _buffer_layer_class() -> type | None:
    """A ``DynamicLayer`` that writes new K/V into a preallocated tensor instead of concatenating."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # transformers without per-layer cache objects: the copying path
        return None

    class BufferLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
            super().__init__()
            self.lazy_initialization(keys, values)
            self._buffers = (keys, values)
            self._length = length
            self.keys, self.values = keys[..., :length, :], values[..., :length, :]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
                   **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self._buffers
            a, z = self._length, self._length + int(key_states.shape[-2])
            if z > keys.shape[-2]:
                raise ShapeMismatchError(f"writing positions {a}..{z - 1} into a {keys.shape[-2]}-position buffer")
            keys[..., a:z, :] = key_states
            values[..., a:z, :] = value_states
            self._length = z
            self.keys, self.values = keys[..., :z, :], values[..., :z, :]
            return self.keys, self.values

    return BufferLayer


def _cache_into(model: Model, out: KVLayers, length: int) -> KVCache | None:
    """A cache holding ``out``'s first ``length`` positions whose updates write into ``out``; None if unsupported.

    Only for models whose cache layers are all plain full-attention ``DynamicLayer`` s (sliding
    windows keep their own buffers).
    """
    cls = _buffer_layer_class()
    if cls is None:
        return None
    from transformers.cache_utils import DynamicLayer

    cache = build_cache([], config=model.config)
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) != len(out) or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    cache.layers = [cls(k, v, length) for k, v in out]
    return cache


def _repair_runs(model: Model, layers: KVLayers, input_ids: torch.Tensor, pos: Sequence[int]) -> KVLayers:
    """Reference semantics: each run of ``pos`` forwarded over the cache cut at its start, left to right."""
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
