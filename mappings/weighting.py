"""Which calibration rows a fit sees, and how much each one weighs.

A least-squares fit weighs every token alike, but a served cache does not use them alike:

- the first positions (the attention sinks) are made exact by a FamilyCache (``sink_tokens``), so
  fitting them only spends the map's capacity on rows it never serves. Their K/V are also far from
  the rest (on the bundled family the relative V error at positions 0-3 is 0.49 against 0.14 after
  position 256), so left in, their few rows pull the whole fit;
- a value enters every later attention output in proportion to the attention it receives, so its
  error costs in that proportion. :class:`RowWeighting` weighs value rows by the attention the
  target's own last queries of each calibration window pay them, mixed with a uniform weight so no
  row drops out of the fit. Keys stay uniform: weighting them too was measured worse
  (``benchmarks/fit_ablation.py``).

Weights are normalised to a mean of 1 over the kept rows of each batch, so the statistics' row
count stays the number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from mappings.capture import KVCapture
    from mappings.methods import MethodSpec
    from mappings.types import Model

__all__ = ["RowWeighting", "RowWeights"]


@dataclass(frozen=True)
class RowWeights:
    """One batch's rows: which are kept, and the weight of each kept value row (None: all alike)."""

    keep: torch.Tensor
    """``[tokens]`` bool: rows the fit sees."""
    values: list[torch.Tensor] | None
    """Per target layer ``[kept tokens]`` value-row weights, mean 1; None when values are uniform."""


@dataclass(frozen=True)
class RowWeighting:
    """How a method weighs calibration rows (from its :class:`~mappings.methods.MethodSpec`)."""

    skip: int = 0
    """Leading positions of every window left out of the fit (the exact sinks of a served cache)."""
    values: str = "uniform"
    """``uniform`` or ``attention``: value rows weighed by the attention they receive."""
    mix: float = 0.5
    """Share of a value row's weight that is its attention (the rest uniform)."""
    queries: int = 128
    """The last queries of each window whose attention weighs the rows."""

    @classmethod
    def of(cls, spec: MethodSpec) -> RowWeighting:
        return cls(skip=spec.exact_sinks, values=spec.value_weights, mix=spec.attention_mix,
                   queries=spec.attention_queries)

    @property
    def plain(self) -> bool:
        """Every row kept and weighed alike: the fit's statistics are the plain ones."""
        return self.skip == 0 and self.values == "uniform"

    @property
    def needs_queries(self) -> bool:
        """Whether the target's queries must be captured (attention-weighted values)."""
        return self.values == "attention"

    def rows(self, capture: KVCapture, target_model: Model) -> RowWeights:
        """The weights of one captured batch of equal-length windows (``capture`` of the target, with queries
        when :attr:`needs_queries`)."""
        import torch

        keep = capture.positions >= self.skip
        if not bool(keep.any()):
            raise ValueError(f"every row of the batch is one of the first {self.skip} positions: use longer windows")
        if not self.needs_queries:
            return RowWeights(keep, None)
        if capture.queries is None:
            raise ValueError("attention-weighted value rows need the target's queries: capture with queries=True")
        if len(set(capture.lengths)) != 1:
            raise ValueError("attention-weighted rows need equal-length windows (calibration windows are)")
        from mappings.capture import decoder_layers
        from mappings.metrics import attention_received

        batch, seq = len(capture.lengths), capture.lengths[0]
        t = max(1, min(self.queries, seq))
        positions = torch.arange(seq - t, seq)
        modules = decoder_layers(target_model)
        weights = []
        for i, (q, k) in enumerate(zip(capture.queries, capture.keys, strict=True)):
            d = k.shape[-1]
            attn = getattr(modules[i], "self_attn", None)
            scaling = float(getattr(attn, "scaling", d**-0.5))
            qd = q.view(batch, seq, -1, d).transpose(1, 2)[:, :, seq - t :]
            kd = k.view(batch, seq, -1, d).transpose(1, 2)
            received = attention_received(qd, kd, positions, scaling).mean(1).reshape(-1)  # [batch * seq]
            received = received[keep.to(received.device)]
            received = received / received.mean().clamp_min(1e-12)
            w = (1 - self.mix) + self.mix * received
            weights.append((w / w.mean()).cpu())
        return RowWeights(keep, weights)
