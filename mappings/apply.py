"""Apply a fitted linear KV map: source cache in, target cache out.

Per target layer ``t`` with source layers ``S_t``: values ``V_t = [V_s for s in S_t] W_v + b_v``;
keys the same in content space — strip the source RoPE, map, apply the target RoPE. It is a
few small matmuls per layer, so mapping costs a tiny fraction of the target's own prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from mappings.cache_io import (
    KVLayers,
    build_cache,
    cache_layers,
    forward_with_cache,
    model_device,
    model_dtype,
)
from mappings.capture import KVShape, kv_shape
from mappings.errors import DocumentTooLongError, NonFiniteKVError, ShapeMismatchError
from mappings.rope import RopeSpec

if TYPE_CHECKING:
    import torch

__all__ = ["LayerMap", "LinearKVMap", "map_cache", "tail_recompute", "identity_map"]


@dataclass
class LayerMap:
    """How one target layer is produced."""

    sources: tuple[int, ...]
    """Source layers whose K (resp. V) are concatenated as input."""
    mode: Literal["map", "passthrough"]
    """``map``: apply the weights; ``passthrough``: copy source layer ``sources[0]`` unchanged."""
    k_weight: torch.Tensor | None = None
    """``[len(sources) * source_width, target_width]`` key map (content space)."""
    k_bias: torch.Tensor | None = None
    """``[target_width]`` key bias (content space) or None."""
    v_weight: torch.Tensor | None = None
    """``[len(sources) * source_width, target_width]`` value map."""
    v_bias: torch.Tensor | None = None
    """``[target_width]`` value bias or None."""
    alpha: float | None = None
    """The regularisation strength chosen for this layer (None for pass-through)."""
    k_down: torch.Tensor | None = None
    """``[p, r]`` low-rank form of the key map: ``y = anchor + (x k_down) k_up + b`` (instead of k_weight)."""
    k_up: torch.Tensor | None = None
    """``[r, target_width]`` second factor of the low-rank key map."""
    v_down: torch.Tensor | None = None
    """``[p, r]`` low-rank form of the value map."""
    v_up: torch.Tensor | None = None
    """``[r, target_width]`` second factor of the low-rank value map."""
    anchored: bool = False
    """Low-rank form only: add the first source layer's features unchanged (the identity anchor)."""

    @property
    def form(self) -> str:
        """``passthrough``, ``dense`` or ``lowrank``."""
        if self.mode == "passthrough":
            return "passthrough"
        return "lowrank" if self.k_down is not None else "dense"

    def dense(self, kind: str) -> torch.Tensor:
        """The map of ``kind`` (``"k"``/``"v"``) as one ``[p, q]`` matrix (pass-through: identity on the first source)."""
        import torch

        if self.mode == "passthrough":
            raise ValueError("a pass-through layer has no weights")
        weight = getattr(self, f"{kind}_weight")
        if weight is not None:
            return weight
        down, up = getattr(self, f"{kind}_down"), getattr(self, f"{kind}_up")
        w = down @ up
        if self.anchored:
            w = w + torch.eye(w.shape[0], w.shape[1], dtype=w.dtype, device=w.device)
        return w

    def tensors(self) -> dict[str, torch.Tensor]:
        """Named tensors of this layer (``k.weight``, ``k.bias``, ``k.down``, ... as present)."""
        out = {}
        for kind in ("k", "v"):
            for part in ("weight", "bias", "down", "up"):
                t = getattr(self, f"{kind}_{part}")
                if t is not None:
                    out[f"{kind}.{part}"] = t
        return out


@dataclass
class LinearKVMap:
    """A per-layer linear map from one model's KV cache to another's."""

    layers: list[LayerMap]
    """One entry per target layer."""
    source_shape: KVShape
    """Cache layout of the source model."""
    target_shape: KVShape
    """Cache layout of the target model."""
    source_rope: RopeSpec
    """Source RoPE (stripped from source keys)."""
    target_rope: RopeSpec
    """Target RoPE (applied to mapped keys)."""
    key_space: Literal["content", "rotated"] = "content"
    """Keys mapped with RoPE stripped (content) or as cached (rotated)."""

    def __post_init__(self) -> None:
        if len(self.layers) != self.target_shape.num_layers:
            raise ShapeMismatchError(
                f"map has {len(self.layers)} layer entries, target has {self.target_shape.num_layers} layers"
            )

    def to(self, device: Any) -> LinearKVMap:
        """Move the weights to ``device`` (in place); returns self."""
        for lm in self.layers:
            for name, t in lm.tensors().items():
                setattr(lm, name.replace(".", "_"), t.to(device))
        return self

    def check_source(self, layers: KVLayers) -> None:
        s = self.source_shape
        if len(layers) != s.num_layers:
            raise ShapeMismatchError(
                f"source cache has {len(layers)} layers, the map expects {s.num_layers}: "
                "this mapping was made for another source model"
            )
        k = layers[0][0]
        if k.dim() != 4 or k.shape[1] != s.kv_heads or k.shape[3] != s.head_dim:
            raise ShapeMismatchError(
                f"source cache layer 0 has shape {tuple(k.shape)}, the map expects "
                f"[batch, {s.kv_heads}, seq, {s.head_dim}]: this mapping was made for another source model"
            )

    def apply(
        self,
        source_layers: KVLayers,
        positions: torch.Tensor | None = None,
        *,
        device: Any = None,
        dtype: Any = None,
        only: set[int] | None = None,
        check_finite: bool = False,
    ) -> KVLayers:
        """Map source ``(K, V)`` per layer (``[batch, heads, seq, dim]``) to the target layout.

        ``positions`` (``[seq]`` or ``[batch, seq]``, default ``0..seq-1``) are the positions of
        the cached tokens. ``only``: compute just these target layers (others are None).
        """
        import torch

        self.check_source(source_layers)
        k0 = source_layers[0][0]
        device = device if device is not None else k0.device
        dtype = dtype if dtype is not None else k0.dtype
        batch, seq = k0.shape[0], k0.shape[2]
        if positions is None:
            positions = torch.arange(seq, device=device)
        positions = positions.to(device)
        seq_len = int(positions.max().item()) + 1 if positions.numel() else 1
        content = self.key_space == "content"
        same_rope = self.source_rope.same_as(self.target_rope)
        s, t = self.source_shape, self.target_shape
        rows = batch * seq
        # RoPE tables once per call, shared by every layer.
        src_tables = self.source_rope.tables(positions, seq_len, device) if content and self.source_rope.is_rotary else None
        tgt_tables = self.target_rope.tables(positions, seq_len, device) if content and self.target_rope.is_rotary else None
        src_k: dict[int, torch.Tensor] = {}
        src_v: dict[int, torch.Tensor] = {}

        def source_keys(i: int) -> torch.Tensor:  # [B*T, Hs*Ds] fp32, content space
            if i not in src_k:
                k = source_layers[i][0].to(device=device, dtype=torch.float32).transpose(1, 2)  # [B, T, H, D]
                if src_tables is not None:
                    k = self.source_rope.strip(k, tables=src_tables, heads_last=True)
                src_k[i] = k.reshape(rows, s.width)
            return src_k[i]

        def source_values(i: int) -> torch.Tensor:
            if i not in src_v:
                v = source_layers[i][1].to(device=device, dtype=torch.float32)
                src_v[i] = v.transpose(1, 2).reshape(rows, s.width)
            return src_v[i]

        def inputs(get, sources: tuple[int, ...]) -> torch.Tensor:
            return get(sources[0]) if len(sources) == 1 else torch.cat([get(i) for i in sources], -1)

        def linear(x: torch.Tensor, lm: LayerMap, kind: str) -> torch.Tensor:
            w, b = getattr(lm, f"{kind}_weight"), getattr(lm, f"{kind}_bias")
            if w is not None:
                w = w.to(device)
                return x @ w if b is None else torch.addmm(b.to(device), x, w)
            down, up = getattr(lm, f"{kind}_down").to(device), getattr(lm, f"{kind}_up").to(device)
            y = (x @ down) @ up
            if lm.anchored:
                y += x[:, : y.shape[1]]
            return y if b is None else y.add_(b.to(device))

        out: KVLayers = []
        for ti, lm in enumerate(self.layers):
            if only is not None and ti not in only:
                out.append((None, None))  # type: ignore[arg-type]
                continue
            if lm.mode == "passthrough" and (same_rope or not content):
                k, v = source_layers[lm.sources[0]]
                out.append((k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)))
                continue
            if lm.mode == "passthrough":
                yk, yv = source_keys(lm.sources[0]), source_values(lm.sources[0])
            else:
                yk = linear(inputs(source_keys, lm.sources), lm, "k")
                yv = linear(inputs(source_values, lm.sources), lm, "v")
            k = yk.view(batch, seq, t.kv_heads, t.head_dim)
            if tgt_tables is not None:
                k = self.target_rope.apply(k, tables=tgt_tables, heads_last=True)
            k = k.transpose(1, 2)
            v = yv.view(batch, seq, t.kv_heads, t.head_dim).transpose(1, 2)
            if check_finite and not (bool(torch.isfinite(yk).all()) and bool(torch.isfinite(yv).all())):
                raise NonFiniteKVError(
                    f"mapped layer {ti} holds NaN/inf: the source cache or the map is broken; recalibrate"
                )
            out.append((k.to(dtype), v.to(dtype)))
        return out

    def num_parameters(self) -> int:
        """Stored numbers (the artifact's size in floats)."""
        return sum(int(t.numel()) for lm in self.layers for t in lm.tensors().values())


def identity_map(source_config: Any, target_config: Any) -> LinearKVMap:
    """The 'reuse the source KV unchanged' map (needs identical cache layouts)."""
    s, t = kv_shape(source_config), kv_shape(target_config)
    if s != t:
        raise ShapeMismatchError(
            f"source KV cannot be reused unchanged: layouts differ ({s.as_dict()} vs {t.as_dict()})"
        )
    return LinearKVMap(
        [LayerMap((i,), "passthrough") for i in range(t.num_layers)], s, t,
        RopeSpec.from_config(source_config), RopeSpec.from_config(source_config), key_space="rotated",
    )


def map_cache(
    kv_map: LinearKVMap,
    source_cache: Any,
    target_model: Any,
    positions: torch.Tensor | None = None,
    *,
    check_finite: bool = True,
) -> Any:
    """Map a source cache (any form) to a ``DynamicCache`` for ``target_model`` (its device and dtype)."""
    layers = cache_layers(source_cache)
    target_cfg = target_model.config
    t = kv_shape(target_cfg)
    if t != kv_map.target_shape:
        raise ShapeMismatchError(
            f"the map produces {kv_map.target_shape.as_dict()}, the target model has {t.as_dict()}: "
            "this mapping was made for another target model"
        )
    seq = int(layers[0][0].shape[-2]) if positions is None else int(positions.max().item()) + 1
    max_pos = getattr(target_cfg, "max_position_embeddings", None)
    if max_pos is not None and seq > max_pos:
        raise DocumentTooLongError(
            f"the cache holds {seq} positions, the target model takes at most {max_pos}: "
            "map a shorter prefix"
        )
    mapped = kv_map.apply(layers, positions, device=model_device(target_model), dtype=model_dtype(target_model),
                          check_finite=check_finite)
    return build_cache(mapped, config=target_cfg)


def tail_recompute(
    target_model: Any, mapped_cache: Any, input_ids: torch.Tensor, m: int
) -> tuple[torch.Tensor, Any]:
    """Recompute the last ``m`` tokens of ``input_ids`` on the target over the mapped prefix.

    ``input_ids`` ``[batch, n]`` is the whole prefix; the mapped cache covers at least its first
    ``n - m`` tokens (longer caches are cut back to ``n - m``). Returns ``(logits of the m tokens,
    cache of n positions)``: the last ``m`` positions are the target's own, exact given the prefix.
    """
    from mappings.cache_io import cache_length, slice_layers

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    n = input_ids.shape[1]
    if not 0 <= m <= n:
        raise ValueError(f"cannot recompute {m} tail tokens of a {n}-token prefix")
    keep = n - m
    length = cache_length(mapped_cache)
    if length < keep:
        raise ShapeMismatchError(f"mapped cache covers {length} tokens, need at least {keep}")
    cache = mapped_cache
    if length > keep:
        cache = build_cache(slice_layers(cache_layers(mapped_cache), 0, keep), config=target_model.config)
    if m == 0:
        import torch

        return torch.empty(input_ids.shape[0], 0, target_model.config.vocab_size), cache
    logits, cache, _ = forward_with_cache(target_model, input_ids[:, keep:], cache)
    return logits, cache
