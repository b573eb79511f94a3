"""Apply a fitted linear KV map: source cache in, target cache out.

Per target layer ``t`` with source layers ``S_t``: values ``V_t = [V_s for s in S_t] W_v + b_v``;
keys the same in content space — strip the source RoPE, map, apply the target RoPE.

Cost: a dense map is two ``width × width`` matmuls per layer and token; for SmolLM2-135M
(width 192 = 3 KV heads × 64, hidden 576) that is about 2 % of the model's own FLOPs per token,
so low-rank maps (``W = I + down @ up``) are stored and applied as factors. RoPE is stripped and
re-applied as one complex multiply on (i, i + d/2) pairs, with the map's key weights reordered to
pair order once, so keys cost two copies instead of a dozen elementwise passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

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
    from collections.abc import Callable, Iterator, Mapping

    import torch

    from mappings.types import CacheLike, DeviceLike, DType, KVCache, Model, ModelConfig

__all__ = ["LayerMap", "LinearKVMap", "map_cache", "map_product", "tail_recompute", "exact_prefix", "identity_map",
           "pair_order_index"]


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
    _pair_order: dict[tuple[str, str, int | None, int | None], dict[str, torch.Tensor]] = field(default_factory=dict, repr=False, compare=False)

    def prepared(self, kind: str, device: DeviceLike | None, in_index: torch.Tensor | None = None,
                 out_index: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``kind``'s tensors ready to apply on ``device`` (cached), optionally with features reordered.

        Dense: ``weight`` (+ ``bias``). Low-rank: ``down`` and ``up`` with the bias appended as an
        extra row, so ``y = anchor + [x·down, 1]·up`` is one fused ``addmm``.
        """
        import torch

        key = (kind, str(device), None if in_index is None else in_index.numel(),
               None if out_index is None else out_index.numel())
        if key not in self._pair_order:
            def pick(t, rows=None, cols=None):
                t = t.to(device)
                if rows is not None:
                    t = t[rows.to(device)]
                if cols is not None:
                    t = t[..., cols.to(device)]
                return t.contiguous()

            weight, bias = getattr(self, f"{kind}_weight"), getattr(self, f"{kind}_bias")
            out: dict[str, torch.Tensor] = {}
            if weight is not None:
                out["weight"] = pick(weight, in_index, out_index)
                if bias is not None:
                    out["bias"] = pick(bias, None, out_index)
            else:
                up = getattr(self, f"{kind}_up")
                up = torch.cat([up, bias[None] if bias is not None else torch.zeros_like(up[:1])], 0)
                out["down"] = pick(getattr(self, f"{kind}_down"), in_index)
                out["up"] = pick(up, None, out_index)
            self._pair_order[key] = out
        return self._pair_order[key]

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


def _all_finite(*tensors: torch.Tensor) -> bool:
    """True when no element is NaN/inf: one reduction per tensor (a NaN or inf anywhere makes the sum
    non-finite), far cheaper than an elementwise mask on every mapped token.

    The sum is fp32 (fp64 tensors stay fp64): a float64 accumulator made this check a fifth of a whole
    map's time on CPU, an fp16 one overflows at 65,504, and an fp32 sum of finite K/V overflows only
    past ~1e38 / tokens per element, values no cache holds (one that did would be broken anyway)."""
    import torch

    def total(t: torch.Tensor) -> torch.Tensor:
        return t.sum() if t.dtype in (torch.float32, torch.float64) else t.sum(dtype=torch.float32)

    return all(bool(torch.isfinite(total(t))) for t in tensors)


def _require_finite(layer: int, *tensors: torch.Tensor) -> None:
    if not _all_finite(*tensors):
        raise NonFiniteKVError(f"mapped layer {layer} holds NaN/inf: the source cache or the map is broken; recalibrate")


class _Sources:
    """The source layers converted for the map (fp32 token rows, keys in content space), each converted on
    first read and released once the last target layer that reads it has been mapped.

    Holding every converted layer to the end of the map kept a second copy of the source cache alive
    (180 MB at 4,096 tokens on the bundled family).
    """

    def __init__(self, keys: Callable[[int], torch.Tensor], values: Callable[[int], torch.Tensor],
                 layers: list[LayerMap], only: set[int] | None) -> None:
        self._convert = {"k": keys, "v": values}
        self._held: dict[tuple[str, int], torch.Tensor] = {}
        self._layers, self._only = layers, only
        self._readers: dict[int, int] = {}
        for _, lm in self.walk(release=False):
            for i in lm.sources:
                self._readers[i] = self._readers.get(i, 0) + 1

    def walk(self, *, release: bool = True) -> Iterator[tuple[int, LayerMap]]:
        """``(index, layer)`` of the target layers to map; moving past one releases what nobody after it reads."""
        for ti, lm in enumerate(self._layers):
            if self._only is not None and ti not in self._only:
                continue
            yield ti, lm
            if release:
                for i in lm.sources:
                    self._readers[i] -= 1
                    if self._readers[i] == 0:
                        self._held.pop(("k", i), None)
                        self._held.pop(("v", i), None)

    def _get(self, kind: str, i: int) -> torch.Tensor:
        if (kind, i) not in self._held:
            self._held[kind, i] = self._convert[kind](i)
        return self._held[kind, i]

    def keys(self, i: int) -> torch.Tensor:
        return self._get("k", i)

    def values(self, i: int) -> torch.Tensor:
        return self._get("v", i)


def pair_order_index(heads: int, head_dim: int, copies: int = 1) -> torch.Tensor:
    """Feature order that puts each RoPE pair ``(i, i + d/2)`` of every head side by side.

    Position ``j`` of the pair-ordered layout holds feature ``index[j]`` of the cache layout
    (``copies`` repeats the pattern for several concatenated source layers).
    """
    import torch

    half = head_dim // 2
    one = torch.arange(head_dim).view(2, half).T.reshape(-1)  # [0, h, 1, h+1, ...]
    per_head = torch.cat([h * head_dim + one for h in range(heads)])
    width = heads * head_dim
    return torch.cat([c * width + per_head for c in range(copies)])


def map_product(x: torch.Tensor, w: Mapping[str, torch.Tensor], anchored: bool) -> torch.Tensor:
    """``x W + b`` (dense) or ``anchor + [x·down, 1]·up`` (low rank, bias folded into ``up``), fused."""
    import torch

    if "weight" in w:
        return x @ w["weight"] if "bias" not in w else torch.addmm(w["bias"], x, w["weight"])
    low = torch.nn.functional.pad(x @ w["down"], (0, 1), value=1.0)
    q = w["up"].shape[1]
    return torch.addmm(x[:, :q], low, w["up"]) if anchored else low @ w["up"]


def _layer_product(x: torch.Tensor, lm: LayerMap, kind: str, device: DeviceLike | None) -> torch.Tensor:
    """The generic path's ``x W + b`` for one layer's keys or values, from the stored (unprepared) weights."""
    import torch

    w, b = getattr(lm, f"{kind}_weight"), getattr(lm, f"{kind}_bias")
    if w is not None:
        w = w.to(device)
        return x @ w if b is None else torch.addmm(b.to(device), x, w)
    down, up = getattr(lm, f"{kind}_down").to(device), getattr(lm, f"{kind}_up").to(device)
    y = (x @ down) @ up
    if lm.anchored:
        y += x[:, : y.shape[1]]
    return y if b is None else y.add_(b.to(device))


def _to_pairs(k: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` cache keys -> ``[B, T, H, D/2]`` complex pairs (one copy)."""
    import torch

    b, h, t, d = k.shape
    pairs = k.reshape(b, h, t, 2, d // 2).permute(0, 2, 1, 4, 3).contiguous()
    return torch.view_as_complex(pairs)


def _from_pairs(z: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D/2]`` complex pairs -> ``[B, H, T, D]`` cache layout (one copy)."""
    import torch

    b, t, h, half = z.shape
    return torch.view_as_real(z).permute(0, 2, 1, 4, 3).reshape(b, h, t, 2 * half)


def _inputs(get: Callable[[int], torch.Tensor], sources: tuple[int, ...]) -> torch.Tensor:
    """The features a target layer maps from: its one source layer's, or several concatenated."""
    import torch

    return get(sources[0]) if len(sources) == 1 else torch.cat([get(i) for i in sources], -1)


@dataclass(frozen=True)
class _MapCall:
    """One :meth:`LinearKVMap.apply` call, resolved: source layers, positions, output device and dtype."""

    source_layers: KVLayers
    positions: torch.Tensor
    seq_len: int
    """Positions the RoPE tables cover (the largest position + 1)."""
    device: DeviceLike
    dtype: DType
    only: set[int] | None
    check_finite: bool
    width: int
    """The source's K/V features per token (heads x head dim)."""

    @property
    def batch(self) -> int:
        """The source cache's batch size."""
        return int(self.source_layers[0][0].shape[0])

    @property
    def seq(self) -> int:
        """The source cache's length in positions."""
        return int(self.source_layers[0][0].shape[2])

    @property
    def rows(self) -> int:
        """Token rows of a converted layer: batch x positions."""
        return self.batch * self.seq

    def values(self, i: int) -> torch.Tensor:
        """Source layer ``i``'s values as ``[B*T, width]`` fp32 token rows on the output device."""
        import torch

        return self.source_layers[i][1].to(device=self.device, dtype=torch.float32).transpose(1, 2).reshape(
            self.rows, self.width)

    def unchanged(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Source layer ``i``'s K/V as cached, on the output's device and dtype (a pass-through layer)."""
        k, v = self.source_layers[i]
        return k.to(device=self.device, dtype=self.dtype), v.to(device=self.device, dtype=self.dtype)


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

    def to(self, device: DeviceLike) -> LinearKVMap:
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
        device: DeviceLike | None = None,
        dtype: DType | None = None,
        only: set[int] | None = None,
        check_finite: bool = False,
        fast: bool = True,
    ) -> KVLayers:
        """Map source ``(K, V)`` per layer (``[batch, heads, seq, dim]``) to the target layout.

        ``positions`` (``[seq]`` or ``[batch, seq]``, default ``0..seq-1``) are the positions of
        the cached tokens. ``only``: compute just these target layers (others are None).
        ``fast``: rotate keys as complex pairs when both models rotate whole heads (same result,
        fewer memory passes); False forces the generic real-valued path.
        """
        import torch

        self.check_source(source_layers)
        k0 = source_layers[0][0]
        device = device if device is not None else k0.device
        dtype = dtype if dtype is not None else k0.dtype
        seq = k0.shape[2]
        if positions is None:
            positions = torch.arange(seq, device=device)
        positions = positions.to(device)
        seq_len = int(positions.max().item()) + 1 if positions.numel() else 1
        s, t = self.source_shape, self.target_shape
        call = _MapCall(source_layers, positions, seq_len, device, dtype, only, check_finite, s.width)
        fast = (fast and self.key_space == "content" and self.source_rope.full_rotary
                and self.target_rope.full_rotary and s.head_dim % 2 == 0 and t.head_dim % 2 == 0)
        return self._apply_pairs(call) if fast else self._apply_generic(call)

    def _apply_generic(self, call: _MapCall) -> KVLayers:
        """The mapped layers by the real-valued path: keys rotated with RoPE tables shared by every layer."""
        import torch

        content = self.key_space == "content"
        same_rope = self.source_rope.same_as(self.target_rope)
        t = self.target_shape
        device, dtype, batch, seq = call.device, call.dtype, call.batch, call.seq
        src_tables = (self.source_rope.tables(call.positions, call.seq_len, device)
                      if content and self.source_rope.is_rotary else None)
        tgt_tables = (self.target_rope.tables(call.positions, call.seq_len, device)
                      if content and self.target_rope.is_rotary else None)

        def convert_keys(i: int) -> torch.Tensor:  # [B*T, Hs*Ds] fp32, content space
            k = call.source_layers[i][0].to(device=device, dtype=torch.float32)
            k = k.transpose(1, 2)  # [B, T, H, D]
            if src_tables is not None:
                k = self.source_rope.strip(k, tables=src_tables, heads_last=True)
            return k.reshape(call.rows, call.width)

        src = _Sources(convert_keys, call.values, self.layers, call.only)
        out: KVLayers = [(None, None)] * len(self.layers)  # type: ignore[list-item]
        for ti, lm in src.walk():
            if lm.mode == "passthrough" and (same_rope or not content):
                out[ti] = call.unchanged(lm.sources[0])
                continue
            if lm.mode == "passthrough":
                yk, yv = src.keys(lm.sources[0]), src.values(lm.sources[0])
            else:
                yk = _layer_product(_inputs(src.keys, lm.sources), lm, "k", device)
                yv = _layer_product(_inputs(src.values, lm.sources), lm, "v", device)
            k = yk.view(batch, seq, t.kv_heads, t.head_dim)
            if tgt_tables is not None:
                k = self.target_rope.apply(k, tables=tgt_tables, heads_last=True)
            k = k.transpose(1, 2)
            v = yv.view(batch, seq, t.kv_heads, t.head_dim).transpose(1, 2)
            if call.check_finite:
                _require_finite(ti, yk, yv)
            out[ti] = (k.to(dtype), v.to(dtype))
        return out

    def _apply_pairs(self, call: _MapCall) -> KVLayers:
        """The mapped layers, keys via complex RoPE pairs (two copies per key instead of a dozen passes).

        Strip and re-apply are one complex multiply each, and the map's key weights are reordered once to pair
        order.
        """
        import torch

        s, t = self.source_shape, self.target_shape
        device, dtype, batch, seq = call.device, call.dtype, call.batch, call.seq
        source_layers = call.source_layers
        same_rope = self.source_rope.same_as(self.target_rope)
        # Phases [T, 1, h] or [B, T, 1, h]: one per position and pair, broadcast over the heads.
        unrotate = self.source_rope.phases(call.positions, call.seq_len, device, inverse=True).unsqueeze(-2)
        rotate = self.target_rope.phases(call.positions, call.seq_len, device).unsqueeze(-2)
        out_index = pair_order_index(t.kv_heads, t.head_dim)

        def convert_keys(i: int) -> torch.Tensor:  # [B*T, Hs*Ds] content space, pair order
            z = _to_pairs(source_layers[i][0].to(device=device, dtype=torch.float32))
            z.mul_(unrotate)
            return torch.view_as_real(z).reshape(call.rows, s.width)

        src = _Sources(convert_keys, call.values, self.layers, call.only)
        out: KVLayers = [(None, None)] * len(self.layers)  # type: ignore[list-item]
        for ti, lm in src.walk():
            if lm.mode == "passthrough" and same_rope:
                out[ti] = call.unchanged(lm.sources[0])
                continue
            if lm.mode == "passthrough":
                z = _to_pairs(source_layers[lm.sources[0]][0].to(device=device, dtype=torch.float32))
                k = _from_pairs(z.mul_(unrotate * rotate))
                out[ti] = (k.to(dtype), source_layers[lm.sources[0]][1].to(device=device, dtype=dtype))
                continue
            in_index = pair_order_index(s.kv_heads, s.head_dim, len(lm.sources))
            yk = map_product(_inputs(src.keys, lm.sources), lm.prepared("k", device, in_index, out_index),
                             lm.anchored)
            z = torch.view_as_complex(yk.view(batch, seq, t.kv_heads, t.head_dim // 2, 2))
            k = _from_pairs(z.mul_(rotate))
            yv = map_product(_inputs(src.values, lm.sources), lm.prepared("v", device), lm.anchored)
            v = yv.view(batch, seq, t.kv_heads, t.head_dim).transpose(1, 2)
            if call.check_finite:
                _require_finite(ti, yk, yv)
            out[ti] = (k.to(dtype), v.to(dtype))
        return out

    def num_parameters(self) -> int:
        """Stored numbers (the artifact's size in floats)."""
        return sum(int(t.numel()) for lm in self.layers for t in lm.tensors().values())


def identity_map(source_config: ModelConfig, target_config: ModelConfig) -> LinearKVMap:
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
    source_cache: CacheLike,
    target_model: Model,
    positions: torch.Tensor | None = None,
    *,
    check_finite: bool = True,
) -> KVCache:
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
    # A pass-through layer is the source's own tensor; the cache returned here is the target's to change in
    # place (exact_prefix writes its sinks into it), so it must not share storage with the source's.
    held = {t.untyped_storage().data_ptr() for pair in layers for t in pair}

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t.untyped_storage().data_ptr() in held else t

    mapped = [(own(k), own(v)) for k, v in mapped]
    return build_cache(mapped, config=target_cfg)


def exact_prefix(target_model: Model, mapped_cache: CacheLike, input_ids: torch.Tensor, count: int) -> int:
    """Overwrite the first ``count`` positions of ``mapped_cache`` with the target's own K/V; returns how many.

    Nothing precedes the first positions, so a forward of their ``count`` tokens alone gives their
    exact K/V. They are the attention sinks: on the bundled family they take about a third of every
    later query's attention and are the worst-mapped positions (``benchmarks/length_growth.py``:
    relative value error 0.49 at positions 0-3 against 0.14 after 256), so making them exact costs a
    ``count``-token forward and removes a sixth to a half of the map's next-token KL
    (``benchmarks/results/length_growth.md``, ``evaluate.md``). The cache is changed in place.
    """
    from mappings.cache_io import cache_length

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    count = max(0, min(int(count), input_ids.shape[1], cache_length(mapped_cache)))
    if count == 0:
        return 0
    _, own, _ = forward_with_cache(target_model, input_ids[:, :count], None, logits_to_keep=1)
    for (k, v), (ok, ov) in zip(cache_layers(mapped_cache), cache_layers(own), strict=True):
        k[:, :, :count] = ok.to(k.dtype)
        v[:, :, :count] = ov.to(v.dtype)
    return count


def tail_recompute(
    target_model: Model, mapped_cache: KVCache, input_ids: torch.Tensor, m: int
) -> tuple[torch.Tensor, KVCache]:
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
