"""Turn calibration statistics + a method + a layer plan into a :class:`LinearKVMap`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mappings.apply import LayerMap, LinearKVMap
from mappings.fit import Block, factorize, fit_linear, head_blocks, identity_prior

if TYPE_CHECKING:
    import torch

    from mappings.capture import KVShape
    from mappings.fit import LayerStats
    from mappings.methods import MethodSpec
    from mappings.rope import RopeSpec

__all__ = ["PASSTHROUGH", "fit_layer", "fit_kv_map", "layer_blocks", "layer_prior"]

PASSTHROUGH = None
"""The per-layer choice meaning 'copy the (first) source layer unchanged'."""


def layer_blocks(spec: MethodSpec, n_sources: int, s: KVShape, t: KVShape) -> list[Block] | None:
    """Per-head blocks for ``granularity == "head"``, else None (one block)."""
    if spec.granularity == "head":
        return head_blocks(n_sources, s.kv_heads, s.head_dim, t.kv_heads, t.head_dim)
    return None


def layer_prior(spec: MethodSpec, n_sources: int, s: KVShape, t: KVShape) -> torch.Tensor | None:
    """``W₀``: identity on the first (best) source layer for anchored methods, else None."""
    if spec.prior != "anchored":
        return None
    return identity_prior(n_sources * s.width, t.width)


def fit_layer(
    stats: LayerStats, spec: MethodSpec, alpha: float | None, sources: Sequence[int], s: KVShape, t: KVShape
) -> LayerMap:
    """One target layer: fitted with ``alpha``, or pass-through when ``alpha`` is None."""
    sources = tuple(sources)
    if alpha is PASSTHROUGH:
        return LayerMap(sources, "passthrough")
    blocks = layer_blocks(spec, len(sources), s, t)
    prior = layer_prior(spec, len(sources), s, t)
    block_width = t.head_dim if blocks else t.width
    rank = spec.rank_for(block_width)
    kw, kb = fit_linear(stats.keys, alpha=alpha, prior=prior, bias=spec.bias, rank=rank, blocks=blocks)
    vw, vb = fit_linear(stats.values, alpha=alpha, prior=prior, bias=spec.bias, rank=rank, blocks=blocks)
    if rank is not None:
        rank = rank * (len(blocks) if blocks else 1)
        kf, vf = factorize(kw, prior, rank), factorize(vw, prior, rank)
        if kf is not None and vf is not None:
            return LayerMap(sources, "map", None, kb, None, vb, float(alpha), kf[0], kf[1], vf[0], vf[1],
                            anchored=prior is not None)
    return LayerMap(sources, "map", kw, kb, vw, vb, float(alpha))


def fit_kv_map(
    stats: Sequence[LayerStats],
    spec: MethodSpec,
    plan: Sequence[Sequence[int]],
    s: KVShape,
    t: KVShape,
    source_rope: RopeSpec,
    target_rope: RopeSpec,
    choices: Sequence[float | None] | None = None,
) -> LinearKVMap:
    """Fit every target layer; ``choices`` gives per-layer α (None: pass-through), default ``spec.default_alpha``."""
    if choices is None:
        choices = [spec.default_alpha] * t.num_layers
    layers = [fit_layer(stats[i], spec, choices[i], plan[i], s, t) for i in range(t.num_layers)]
    return LinearKVMap(layers, s, t, source_rope, target_rope, key_space=spec.key_space)
