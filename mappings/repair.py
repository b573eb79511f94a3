"""Map, then repair: spend a budget of target compute to close the gap between a mapped cache and
the target's own prefill.

A :class:`RepairPolicy` says how much (``budget``, a fraction of one full target prefill of the
document) and on what:

- token repair: the first ``sink_tokens`` document tokens (attention sinks: nothing precedes
  them, so their recomputed K/V are exact), the last tokens (the ones the next tokens attend to
  most; they also serve the online gate), and optionally interior tokens with the highest
  predicted mapping error (the source's attention from its last tokens: what the continuation
  will read). Recomputing ``k`` of ``n`` tokens costs about ``k / n`` of a prefill.
- layer repair: contiguous blocks of target layers recomputed for every token from a hidden state
  mapped by the residual-stream maps (exact when the block starts at layer 0). A block of ``b``
  of ``L`` layers costs about ``b / L``. Blocks are chosen from the mapping's calibration
  metrics (worst attention-output cosine first) unless given.

Measured on the bundled SmolLM2 family (``orchestra bench`` repair section): the KV-map error is
spread over all layers (replacing any single layer by the truth moves next-token KL by < 10 %),
while recomputing sink and tail tokens removes most of it; so the default policy spends the
whole budget on tokens, and layer repair is there for pairs whose error concentrates in a few
layers (the evaluation's single-layer curve shows which).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mappings.errors import MappingError, ShapeMismatchError

if TYPE_CHECKING:
    import torch

    from mappings.cache_io import KVLayers
    from mappings.manifest import MappingManifest
    from mappings.residual import ResidualMap

__all__ = [
    "RepairPolicy",
    "RepairPlan",
    "RepairResult",
    "RepairUnavailableError",
    "plan_repair",
    "layer_scores",
    "choose_blocks",
    "attention_importance",
    "repair_cache",
]


class RepairUnavailableError(MappingError):
    """The policy asks for a repair the mapping cannot do (e.g. layer blocks without residual maps)."""


class RepairPolicy(BaseModel):
    """How much target compute to spend repairing a mapped cache, and where."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget: float = Field(default=0.0, ge=0.0, le=1.0)
    """Fraction of one full target prefill of the document to spend (0: pure map)."""
    sink_tokens: int = Field(default=4, ge=0)
    """First document tokens recomputed (exact: nothing precedes them); counted in the budget."""
    layer_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of the budget spent on layer blocks recomputed from mapped hidden states."""
    scattered_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of the token budget spent on interior tokens the source's last tokens attend to most."""
    probe_tokens: int = Field(default=16, ge=1)
    """Source tokens whose attention ranks the interior tokens (only with ``scattered_share``)."""
    blocks: tuple[tuple[int, int], ...] | None = None
    """Explicit layer blocks ``[start, stop)``; None: chosen from the mapping's calibration metrics."""

    @field_validator("blocks")
    @classmethod
    def _blocks_ordered(cls, value: tuple[tuple[int, int], ...] | None) -> tuple[tuple[int, int], ...] | None:
        if value is None:
            return value
        for a, z in value:
            if not 0 <= a < z:
                raise ValueError(f"layer block [{a}, {z}) is empty or negative: write blocks as [start, stop)")
        return value

    @property
    def label(self) -> str:
        """Short name for tables: ``repair@10%`` (+ ``L<share>`` / ``S<share>`` when used)."""
        parts = [f"repair@{self.budget * 100:g}%"]
        if self.layer_share:
            parts.append(f"L{self.layer_share:g}")
        if self.scattered_share:
            parts.append(f"S{self.scattered_share:g}")
        return ",".join(parts)


@dataclass(frozen=True)
class RepairPlan:
    """What a policy recomputes on one document."""

    tokens: tuple[int, ...]
    """Positions recomputed (sorted)."""
    blocks: tuple[tuple[int, int], ...]
    """Layer blocks ``[start, stop)`` recomputed for every token."""
    tail: int
    """How many of ``tokens`` are the trailing run."""
    scattered: int
    """How many of ``tokens`` are interior tokens picked by attention."""
    cost: float
    """Estimated compute as a fraction of a full prefill (tokens / n + layers / L)."""


@dataclass
class RepairResult:
    """A repaired cache's layers and what it took."""

    layers: KVLayers
    plan: RepairPlan
    policy: RepairPolicy
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """JSON form for reports and events: the policy, what was recomputed, its planned cost, seconds."""
        return {"policy": self.policy.model_dump(mode="json"), "tokens": len(self.plan.tokens), "tail": self.plan.tail,
                "scattered": self.plan.scattered, "blocks": [list(b) for b in self.plan.blocks],
                "cost": self.plan.cost, "seconds": dict(self.seconds)}


def layer_scores(manifest: MappingManifest) -> list[float]:
    """Per target layer, how much repairing it should help: 1 − held-out attention-output cosine.

    Falls back to 1 − key cosine for mappings calibrated without attention metrics, and to 0 for a
    layer without metrics. These are the scores :func:`choose_blocks` and :func:`plan_repair` rank
    layer blocks by.
    """
    scores = []
    by_layer = {m.layer: m for m in manifest.metrics}
    for e in sorted(manifest.layer_plan, key=lambda e: e.target_layer):
        m = by_layer.get(e.target_layer)
        if m is None:
            scores.append(0.0)
        elif m.attn_cosine is not None:
            scores.append(max(0.0, 1.0 - m.attn_cosine))
        else:
            scores.append(max(0.0, 1.0 - m.keys.cosine))
    return scores


def choose_blocks(layer_scores: Sequence[float], layers: int) -> tuple[tuple[int, int], ...]:
    """The contiguous block of ``layers`` layers with the largest total score (earliest on ties)."""
    n = len(layer_scores)
    if layers <= 0 or n == 0:
        return ()
    layers = min(layers, n)
    best, start = -math.inf, 0
    for a in range(0, n - layers + 1):
        s = float(sum(layer_scores[a : a + layers]))
        if s > best + 1e-12:
            best, start = s, a
    return ((start, start + layers),)


def plan_repair(
    policy: RepairPolicy, n: int, num_layers: int, *, layer_scores: Sequence[float] | None = None,
    importance: torch.Tensor | None = None,
) -> RepairPlan:
    """Turn a policy into positions and blocks for an ``n``-token document on ``num_layers`` layers."""
    if n < 1:
        raise ShapeMismatchError("nothing to repair: the document is empty")
    layer_budget = policy.budget * policy.layer_share
    if policy.blocks is not None:
        blocks = tuple(policy.blocks)
        for _a, z in blocks:
            if z > num_layers:
                raise ShapeMismatchError(f"layer block ending at {z} is outside the target's {num_layers} layers")
    else:
        count = int(math.floor(layer_budget * num_layers + 1e-9))
        if count and layer_scores is None:
            raise RepairUnavailableError("choosing layer blocks needs per-layer scores from the mapping's metrics")
        blocks = choose_blocks(layer_scores or [], count) if count else ()
    block_layers = sum(z - a for a, z in blocks)
    token_budget = max(0, int(math.floor((policy.budget - block_layers / num_layers) * n + 1e-9)))
    sink = min(policy.sink_tokens, token_budget, n)
    rest = token_budget - sink
    scattered_n = int(rest * policy.scattered_share) if importance is not None else 0
    tail_n = min(rest - scattered_n, n - sink)
    chosen = set(range(sink)) | set(range(n - tail_n, n))
    if scattered_n:
        ranked = importance[: n - tail_n].clone()
        ranked[:sink] = -math.inf
        for p in ranked.topk(min(scattered_n, max(0, n - tail_n - sink))).indices.tolist():
            chosen.add(int(p))
    tokens = tuple(sorted(chosen))
    return RepairPlan(tokens=tokens, blocks=blocks, tail=tail_n, scattered=len(tokens) - tail_n - sink,
                      cost=len(tokens) / n + block_layers / num_layers)


def attention_importance(model: Any, layers: KVLayers, input_ids: torch.Tensor, probe_tokens: int = 16) -> torch.Tensor:
    """How much ``model``'s last ``probe_tokens`` tokens attend to each position, ``[n]``.

    Re-runs the last tokens over ``layers`` (the model's own cache of ``input_ids``, cut before
    them) capturing their queries, then averages the softmax attention over probes, heads and
    layers. Cost: ``probe_tokens`` tokens of a forward pass.
    """
    import torch

    from mappings.cache_io import build_cache, forward_with_cache, slice_layers
    from mappings.capture import capture_queries
    from mappings.rope import RopeSpec

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    n = input_ids.shape[1]
    t = max(1, min(probe_tokens, n - 1))
    with capture_queries(model) as queries:
        forward_with_cache(model, input_ids[:, n - t :], build_cache(slice_layers(layers, 0, n - t), model.config),
                           logits_to_keep=1)
    rope = RopeSpec.from_config(model.config)
    positions = torch.arange(n - t, n)
    total = torch.zeros(n)
    for i, (k, _v) in enumerate(layers):
        kv_heads, d = k.shape[1], k.shape[-1]
        q = queries[i].float()
        q = q.reshape(q.shape[0], t, -1, d).transpose(1, 2)  # [B, H, t, d]
        q = rope.apply(q, positions.to(q.device))
        groups = q.shape[1] // kv_heads
        keys = k[:1].float().repeat_interleave(groups, dim=1)  # [1, H, n, d]
        scores = (q[:1] @ keys.transpose(-1, -2)) / math.sqrt(d)
        causal = torch.arange(n, device=scores.device)[None, :] > positions.to(scores.device)[:, None]
        scores.masked_fill_(causal, -math.inf)
        total += scores.softmax(-1).mean(dim=(0, 1, 2)).cpu()
    return total / len(layers)


def repair_cache(
    target: Any,
    mapped: KVLayers,
    input_ids: torch.Tensor,
    policy: RepairPolicy,
    *,
    layer_scores: Sequence[float] | None = None,
    residual: ResidualMap | None = None,
    source_hidden: dict[int, torch.Tensor] | None = None,
    source: Any = None,
    source_layers: KVLayers | None = None,
    importance: torch.Tensor | None = None,
) -> RepairResult:
    """Apply ``policy`` to a mapped cache of ``input_ids`` on ``target``; returns the repaired layers.

    Layer blocks starting after layer 0 need ``residual`` maps and the source hidden states they
    read (``source_hidden[s]``: the state entering source layer ``s``, ``[batch, n, d]``).
    Scattered tokens need ``source`` and its own cache ``source_layers`` to rank positions, or
    the ranking itself (``importance``: `attention_importance` of the source, computed elsewhere).
    Blocks run first, then one masked pass recomputes the chosen tokens over the result.
    """
    from mappings.recompute import embed, repair_tokens, run_layers

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    n, num_layers = input_ids.shape[1], len(mapped)
    seconds: dict[str, float] = {}
    if policy.budget and policy.scattered_share and importance is None:
        if source is None or source_layers is None:
            raise RepairUnavailableError("scattered token repair ranks tokens by the source's attention: pass "
                                         "source= and source_layers=")
        t0 = time.perf_counter()
        importance = attention_importance(source, source_layers, input_ids, policy.probe_tokens)
        seconds["rank"] = time.perf_counter() - t0
    plan = plan_repair(policy, n, num_layers, layer_scores=layer_scores, importance=importance)
    layers = list(mapped)
    if plan.blocks:
        t0 = time.perf_counter()
        for a, z in plan.blocks:
            if a == 0:
                hidden = embed(target, input_ids)
            else:
                if residual is None or source_hidden is None:
                    raise RepairUnavailableError(
                        f"layer block [{a}, {z}) starts after layer 0: it needs the mapping's residual maps "
                        "(add them with `orchestra calibrate-repair --mapping DIR --corpus FILE`) and the "
                        "source's hidden states"
                    )
                s = residual.layers[a].source
                if s not in source_hidden:
                    raise RepairUnavailableError(f"source hidden state entering layer {s} was not captured")
                hidden = residual.apply(a, source_hidden[s]).to(layers[0][0].dtype)
            _, kv = run_layers(target, hidden, a, z)
            for j, pair in enumerate(kv):
                layers[a + j] = (pair[0].to(layers[a + j][0].dtype), pair[1].to(layers[a + j][1].dtype))
        seconds["layers"] = time.perf_counter() - t0
    if plan.tokens:
        t0 = time.perf_counter()
        layers = repair_tokens(target, layers, input_ids, plan.tokens)
        seconds["tokens"] = time.perf_counter() - t0
    return RepairResult(layers, plan, policy, seconds)
