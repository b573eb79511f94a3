"""Residual-stream maps: the source's hidden state entering a layer -> the target's entering its layer.

Same machinery as the KV maps (streaming sufficient statistics, identity-anchored ridge solved
in closed form), applied to the hidden state ``h_i`` that enters decoder layer ``i``. With a
mapped ``h_i`` the target recomputes layers ``i..j`` for every document token exactly as its
own forward pass does (:func:`mappings.recompute.run_layers`), so those layers' K/V are the
target's own up to the error of the mapped starting point. ``h_0`` needs no map: it is the
target's embedding of the tokens, so a block starting at layer 0 is exact.

Target layer ``i`` is fed from source hidden state ``sources[i]`` (the KV map's layer plan:
the same index for same-depth pairs, the matched source layer when depths differ).

This module is the maps only (data, fit, apply, tensors); adding them to a calibrated mapping
(loading the models, cutting the corpus, recording the planner's blocks) is
:mod:`mappings.calibrate_repair`, so the store can load a :class:`ResidualMap` without pulling in
calibration.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mappings.errors import CorruptMappingError, ShapeMismatchError
from mappings.manifest import RESIDUAL_FILE

if TYPE_CHECKING:
    import torch

    from mappings.fit import RegressionStats
    from mappings.types import Model

__all__ = ["ResidualMap", "ResidualLayer", "capture_hidden", "fit_residual_maps", "RESIDUAL_FILE"]

_ALPHAS = (0.01, 0.03, 0.1, 0.3, 1.0)
_RANK = 64


@dataclass
class ResidualLayer:
    """How the hidden state entering one target layer is produced."""

    source: int
    """Source hidden-state index (the input of source layer ``source``)."""
    alpha: float
    """Chosen relative ridge strength."""
    bias: torch.Tensor
    """``[d_target]``."""
    weight: torch.Tensor | None = None
    """``[d_source, d_target]`` dense map (widths differ, or low rank would not save)."""
    down: torch.Tensor | None = None
    """``[d, r]``: ``y = x + x down up + b`` (identity-anchored low-rank form, equal widths)."""
    up: torch.Tensor | None = None
    """``[r, d]``."""
    r2: float = 0.0
    """Held-out R² of the mapped hidden state."""
    cosine: float = 0.0
    """Held-out mean per-token cosine(mapped, true)."""
    identity_cosine: float | None = None
    """The same for the source hidden state unchanged (equal widths only)."""

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``x`` ``[..., d_source]`` (any dtype) to the target's hidden state, fp32."""
        x = x.float()
        if self.weight is not None:
            return x @ self.weight.to(x.device) + self.bias.to(x.device)
        assert self.down is not None and self.up is not None, "a residual layer is dense or low-rank"
        return x + (x @ self.down.to(x.device)) @ self.up.to(x.device) + self.bias.to(x.device)


@dataclass
class ResidualMap:
    """Per target layer, a map of the hidden state entering it."""

    layers: list[ResidualLayer]
    source_width: int
    target_width: int
    seconds: float = 0.0
    tokens: int = 0
    _device_cache: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def apply(self, layer: int, source_hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden state entering ``layer``, from the source's hidden state feeding it."""
        if not 0 <= layer < len(self.layers):
            raise ShapeMismatchError(f"no residual map for target layer {layer} (0..{len(self.layers) - 1})")
        if source_hidden.shape[-1] != self.source_width:
            raise ShapeMismatchError(
                f"source hidden states are {source_hidden.shape[-1]} wide, the residual map expects "
                f"{self.source_width}: this mapping was made for another source model"
            )
        return self.layers[layer].apply(source_hidden)

    def tensors(self) -> dict[str, torch.Tensor]:
        import torch

        out: dict[str, torch.Tensor] = {}
        for i, lm in enumerate(self.layers):
            out[f"residual.{i}.bias"] = lm.bias.contiguous()
            out[f"residual.{i}.meta"] = torch.tensor([float(lm.source), lm.alpha, lm.r2, lm.cosine,
                                                      -1.0 if lm.identity_cosine is None else lm.identity_cosine])
            for name in ("weight", "down", "up"):
                t = getattr(lm, name)
                if t is not None:
                    out[f"residual.{i}.{name}"] = t.contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> ResidualMap:
        count = len({k.split(".")[1] for k in tensors if k.startswith("residual.")})
        layers = []
        try:
            for i in range(count):
                meta = tensors[f"residual.{i}.meta"].tolist()
                layers.append(ResidualLayer(
                    source=int(meta[0]), alpha=float(meta[1]), r2=float(meta[2]), cosine=float(meta[3]),
                    identity_cosine=None if meta[4] < 0 else float(meta[4]), bias=tensors[f"residual.{i}.bias"],
                    weight=tensors.get(f"residual.{i}.weight"), down=tensors.get(f"residual.{i}.down"),
                    up=tensors.get(f"residual.{i}.up"),
                ))
        except KeyError as exc:
            raise CorruptMappingError(f"{RESIDUAL_FILE} is missing tensor {exc}: recalibrate the repair") from exc
        if not layers:
            raise CorruptMappingError(f"{RESIDUAL_FILE} holds no residual maps: recalibrate the repair")
        first = layers[0]
        if first.weight is not None:
            d_in = first.weight.shape[0]
        else:
            assert first.down is not None, "a residual layer is dense or low-rank"
            d_in = first.down.shape[0]
        return cls(layers, int(d_in), int(first.bias.shape[0]))


def capture_hidden(model: Model, windows: Sequence[torch.Tensor], batch_size: int = 4) -> list[torch.Tensor]:
    """Hidden states entering every decoder layer, fp32, ``[windows * T, d]`` per layer."""
    import torch

    from mappings.cache_io import model_device

    per_layer: list[list[torch.Tensor]] = []
    dev = model_device(model)
    for a in range(0, len(windows), batch_size):
        ids = torch.stack(list(windows[a : a + batch_size])).to(dev)
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        hs = out.hidden_states[:-1]  # the last one leaves the final norm, it enters no layer
        if not per_layer:
            per_layer = [[] for _ in hs]
        for i, h in enumerate(hs):
            per_layer[i].append(h.float().reshape(-1, h.shape[-1]).cpu())
    return [torch.cat(parts) for parts in per_layer]


def _stats(x: torch.Tensor, y: torch.Tensor) -> RegressionStats:
    from mappings.fit import RegressionStats

    return RegressionStats.from_data(x.double(), y.double())


def fit_residual_maps(
    source: Model,
    target: Model,
    train: Sequence[torch.Tensor],
    heldout: Sequence[torch.Tensor],
    sources: Sequence[int],
    *,
    alphas: Sequence[float] = _ALPHAS,
    rank: int | None = _RANK,
    batch_size: int = 4,
) -> ResidualMap:
    """Fit one identity-anchored ridge map per target layer on ``train`` windows.

    ``sources[i]``: the source hidden-state index feeding target layer ``i``. The ridge strength
    of each layer is chosen by held-out relative error on ``heldout`` windows; equal widths store
    the correction ``W − I`` at rank ``rank`` (the anchor keeps what the ranks drop).
    """
    from mappings.fit import factorize, fit_linear, identity_prior
    from mappings.metrics import fit_quality, mean_cosine

    t0 = time.perf_counter()
    src_h, tgt_h = capture_hidden(source, train, batch_size), capture_hidden(target, train, batch_size)
    src_v, tgt_v = capture_hidden(source, heldout, batch_size), capture_hidden(target, heldout, batch_size)
    if len(sources) != len(tgt_h):
        raise ShapeMismatchError(f"layer plan covers {len(sources)} target layers, the target has {len(tgt_h)}")
    d_s, d_t = src_h[0].shape[-1], tgt_h[0].shape[-1]
    layers: list[ResidualLayer] = []
    for i, s in enumerate(sources):
        stats = _stats(src_h[s], tgt_h[i])
        prior = identity_prior(d_s, d_t) if d_s == d_t else None
        best: tuple[float, float, torch.Tensor, torch.Tensor] | None = None
        for alpha in alphas:
            w, b = fit_linear(stats, alpha=alpha, prior=prior, bias="regularized")
            assert b is not None  # a "regularized" bias is always fitted
            err = float(((src_v[s] @ w + b - tgt_v[i]) ** 2).sum())
            if best is None or err < best[0]:
                best = (err, alpha, w, b)
        assert best is not None
        _, alpha, w, b = best
        entry = ResidualLayer(source=int(s), alpha=float(alpha), bias=b.float())
        factors = factorize(w, prior.float() if prior is not None else None, rank) if rank and prior is not None \
            else None
        if factors is not None:
            entry.down, entry.up = factors
        else:
            entry.weight = w.float()
        quality = fit_quality(entry.apply(src_v[s]), tgt_v[i])
        entry.r2, entry.cosine = quality["r2"], quality["cosine"]
        if d_s == d_t:
            entry.identity_cosine = mean_cosine(src_v[s], tgt_v[i])
        layers.append(entry)
    return ResidualMap(layers, d_s, d_t, seconds=time.perf_counter() - t0,
                       tokens=sum(int(w.numel()) for w in train))
