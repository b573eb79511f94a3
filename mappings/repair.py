"""Map, then repair: spend a budget of target compute to close the gap between a mapped cache and
the target's own prefill.

A :class:`RepairPolicy` says how much (``budget``, a share of the compute of one full target
prefill of the document) and on what:

- token repair: the first ``sink_tokens`` document tokens (attention sinks: nothing precedes
  them, so their recomputed K/V are exact), the last tokens (the ones the next tokens attend to
  most; they also serve the online gate), and optionally interior tokens with the highest
  predicted mapping error (the source's attention from its last tokens: what the continuation
  will read). Recomputing ``k`` of ``n`` tokens feeds ``k`` tokens through the target, but costs
  more than ``k / n`` of a prefill when they come late: a trailing token scores about ``n`` keys
  per layer, an average prefill token ``n / 2``.
- layer repair: contiguous blocks of target layers recomputed for every token from a hidden state
  mapped by the residual-stream maps (exact when the block starts at layer 0). A block of ``b``
  of ``L`` layers costs ``b / L`` (every token through ``b`` of ``L`` layers). Blocks are chosen
  from the mapping's calibration metrics (worst attention-output cosine first) unless given.

Cost: the budget, a plan's ``cost``, a ladder's spend and ``max_spend`` are all the same measure,
:func:`compute_share`: the multiply-adds of the passes the repair makes, attention included, as a
share of the target's causal prefill of the document, from the target's sizes (its config). Without
those sizes they fall back to the token share (``tokens / n + layers / L``, what a plan records as
``token_share``).

Adaptive budget (:func:`climb_repair`): a policy with a ``ladder`` of budgets starts at ``budget``
(usually 0, the pure map), checks a probe over the last tokens, and only when it fails repairs up
to the next budget and probes again, until the probe passes, the ladder ends, or the spend would
pass ``max_spend`` (compute, as the budget). Positions already repaired stay repaired: a rung
recomputes only its new positions plus the probe tokens.

Measured on the bundled SmolLM2 family (``orchestra bench`` repair section): the KV-map error is
spread over all layers (replacing any single layer by the truth moves next-token KL by < 10 %),
while recomputing sink and tail tokens removes most of it; so the default policy spends the
whole budget on tokens, and layer repair is there for pairs whose error concentrates in a few
layers (the evaluation's single-layer curve shows which).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mappings.errors import MappingError, ShapeMismatchError
from mappings.passcost import CostModel
from mappings.repair_records import LadderStep, RepairLadder, RepairSummary

if TYPE_CHECKING:
    import torch

    from mappings.cache_io import KVLayers
    from mappings.manifest import MappingManifest
    from mappings.residual import ResidualMap
    from mappings.types import Model, ModelConfig

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
    "climb_repair",
    "compute_share",
    "Probe",
    "LadderStep",
    "RepairLadder",
    "RepairSummary",
]

Probe = Callable[["torch.Tensor"], tuple[bool, dict[str, float]]]
"""A gate over the logits ``[batch, tail, vocab]`` of a cache's last tokens: (passed, its metrics)."""


class RepairUnavailableError(MappingError):
    """The policy asks for a repair the mapping cannot do (e.g. layer blocks without residual maps)."""


class RepairPolicy(BaseModel):
    """How much target compute to spend repairing a mapped cache, and where."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of one full target prefill's compute to spend (0: pure map): the plan's :func:`compute_share`,
    attention included, stays within it (the token share without the target's sizes)."""
    sink_tokens: int = Field(default=4, ge=0)
    """First document tokens recomputed (exact: nothing precedes them); counted in the budget."""
    layer_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of the budget spent on layer blocks recomputed from mapped hidden states."""
    scattered_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of the token budget spent on interior tokens the source's last tokens attend to most."""
    probe_tokens: int = Field(default=16, ge=1)
    """Source tokens whose attention ranks the interior tokens (only with ``scattered_share``)."""
    focus: tuple[int, ...] | Literal["question"] | None = None
    """What ranks the interior tokens (``scattered_share``) instead of the document's last ``probe_tokens``:
    token ids read after the document (an agent's instructions and question), whose attention on the source
    picks what the question reads; ``"question"`` in an agent's or pipeline's policy: the agent's own
    suffix, filled in by the pipeline when the agent runs. None: the document's tail ranks them."""
    blocks: tuple[tuple[int, int], ...] | None = None
    """Explicit layer blocks ``[start, stop)``; None: chosen from the mapping's calibration metrics."""
    ladder: tuple[float, ...] = ()
    """Adaptive budgets: when the probe fails at ``budget``, repair up to each larger one in turn and re-probe."""
    max_spend: float = Field(default=1.0, gt=0.0)
    """Adaptive: stop climbing before the ladder's recompute (its compute share, as ``budget``) would pass this;
    re-prefill is 1."""

    @field_validator("ladder")
    @classmethod
    def _ladder_fractions(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        for b in value:
            if not 0.0 <= b <= 1.0:
                raise ValueError(f"ladder budget {b} is not a fraction of a prefill in [0, 1]")
        return value

    @model_validator(mode="after")
    def _ladder_repairs_tokens(self) -> RepairPolicy:
        if self.ladder and (self.layer_share or self.blocks is not None):
            raise ValueError("an adaptive ladder repairs tokens only: leave layer_share at 0 and blocks unset")
        return self

    @property
    def focus_ids(self) -> tuple[int, ...] | None:
        """The token ids that rank the interior tokens (None: the document's tail, also for an unfilled
        ``"question"``)."""
        return self.focus if isinstance(self.focus, tuple) and self.focus else None

    @property
    def adaptive(self) -> bool:
        """True when the policy climbs a ladder of budgets against a probe."""
        return bool(self.ladder)

    @property
    def rungs(self) -> tuple[float, ...]:
        """The budgets tried in order: ``budget`` first, then the larger ladder budgets."""
        return tuple(sorted({self.budget, *(b for b in self.ladder if b > self.budget)}))

    @property
    def max_budget(self) -> float:
        """The largest budget the policy may spend on one rung (``budget`` for a fixed policy)."""
        return self.rungs[-1]

    def at(self, budget: float) -> RepairPolicy:
        """This policy as a fixed one at ``budget`` (one rung of its ladder)."""
        return self.model_copy(update={"budget": budget, "ladder": ()})

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
        """Short name for tables: ``repair@10%`` (+ ``L<share>`` / ``S<share>`` when used; ``repair@0/5/10%``
        for a ladder)."""
        budgets = "/".join(f"{b * 100:g}" for b in self.rungs)
        parts = [f"repair@{budgets}%"]
        if self.layer_share:
            parts.append(f"L{self.layer_share:g}")
        if self.scattered_share:
            parts.append(f"S{self.scattered_share:g}")
        if self.focus:
            parts.append("Q")
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
    """Planned compute as a share of a full prefill: multiply-adds counting attention (:func:`compute_share`),
    what the budget bounds; the token share when the target's sizes are unknown. Above ``token_share`` for a
    long tail: its tokens score ~n keys each, a prefill's n / 2 on average."""
    token_share: float
    """The plan's size: recomputed tokens / n + recomputed layers / L (the linear cost model)."""
    costs: str = "compute"
    """What ``cost`` measures: ``measured`` (the target's timed passes, :class:`~mappings.passcost.PassCosts`),
    ``compute`` (multiply-adds from its config) or ``tokens`` (the token share)."""
    exact: int = 0
    """Leading positions computed exactly before the repair (not in ``tokens``, counted in ``cost``)."""


@dataclass
class RepairResult:
    """A repaired cache's layers and what it took."""

    layers: KVLayers
    plan: RepairPlan
    """The plan applied (for a ladder: the last rung's)."""
    policy: RepairPolicy
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds by part: ``rank`` (source), ``layers`` and ``tokens`` (target)."""
    logits: torch.Tensor | None = None
    """Logits ``[batch, m, vocab]`` of the last ``m`` positions, when asked for (``keep_logits``, a ladder's probe)."""
    ladder: RepairLadder | None = None
    """An adaptive repair's climb: budgets tried, the one that passed, the spend (see :func:`climb_repair`)."""

    @property
    def target_seconds(self) -> float:
        """Seconds the target spent recomputing (layer blocks and tokens): what ``plan.cost`` estimates."""
        return float(self.seconds.get("layers", 0.0) + self.seconds.get("tokens", 0.0))

    def record(self) -> RepairSummary:
        """The typed summary: the policy, what was recomputed, its planned cost, seconds, the ladder's climb."""
        return RepairSummary(policy=self.policy.model_dump(mode="json"), tokens=len(self.plan.tokens),
                             tail=self.plan.tail, scattered=self.plan.scattered,
                             blocks=[list(b) for b in self.plan.blocks], cost=self.plan.cost, costs=self.plan.costs,
                             exact=self.plan.exact, token_share=self.plan.token_share, seconds=dict(self.seconds),
                             ladder=self.ladder)

    def summary(self) -> dict[str, object]:
        """JSON form of :meth:`record` for reports and events."""
        return self.record().model_dump()


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
    importance: torch.Tensor | None = None, config: ModelConfig | None = None, costs: CostModel | None = None,
    exact: int = 0,
) -> RepairPlan:
    """Turn a policy into positions and blocks for an ``n``-token document on ``num_layers`` layers.

    Layer blocks first (``layer_share`` of the budget, ``b / L`` each); then the tokens, in order:
    the sinks, ``scattered_share`` of the rest on interior tokens, the remainder on the tail. The
    plan is the largest (most tokens) whose ``cost`` stays within ``policy.budget``.

    ``config``: the target's model config (hidden, heads, KV heads, head dim, intermediate size,
    layers, as :func:`compute_share` reads them). With it ``cost`` is the plan's compute share,
    attention included, and the token count is found by binary search (a trailing token costs more
    than ``1 / n``, so a 10 % budget recomputes fewer than 10 % of the tokens at long context).
    Default None (or a config without those sizes): ``cost`` is the token share ``tokens / n +
    layers / L``, the linear model, and the plan is ``floor((budget - layers / L) * n)`` tokens.

    ``costs``: a measured :class:`~mappings.passcost.PassCosts` of the target (or any
    :class:`~mappings.passcost.CostModel`) prices the plan instead of ``config``: the budget is then a
    share of the target's prefill *seconds* on this machine, per-pass overheads included.
    ``exact``: the first ``exact`` positions were already computed exactly on the target (the sink
    pass of a mapped cache): the plan does not recompute them, but its cost counts their pass, so
    the budget bounds everything the target spends on the cache.
    """
    if n < 1:
        raise ShapeMismatchError("nothing to repair: the document is empty")
    blocks = _plan_blocks(policy, num_layers, layer_scores)
    block_layers = sum(z - a for a, z in blocks)
    block_share = block_layers / num_layers
    model = costs if costs is not None else _ComputeModel.of(config)
    done = set(range(min(max(0, exact), n)))
    slots = _TokenSlots(n, policy.sink_tokens, policy.scattered_share, importance)
    chosen, tail_n, sink = slots.choose(_slot_count(slots, model, done, block_share, policy.budget))
    spent = sorted(done.union(chosen))
    token_share = len(spent) / n + block_share
    cost = model.share(n, spent) + block_share if model is not None else token_share
    tokens = tuple(p for p in chosen if p not in done)
    return RepairPlan(tokens=tokens, blocks=blocks, tail=tail_n, scattered=len(chosen) - tail_n - sink, cost=cost,
                      token_share=token_share, costs=model.kind if model is not None else "tokens", exact=len(done))


def _plan_blocks(policy: RepairPolicy, num_layers: int,
                 layer_scores: Sequence[float] | None) -> tuple[tuple[int, int], ...]:
    """The layer blocks ``[start, stop)`` to recompute: the policy's own, or the best-scored for its share."""
    if policy.blocks is not None:
        blocks = tuple(policy.blocks)
        for _a, z in blocks:
            if z > num_layers:
                raise ShapeMismatchError(f"layer block ending at {z} is outside the target's {num_layers} layers")
        return blocks
    layer_budget = policy.budget * policy.layer_share
    count = int(math.floor(layer_budget * num_layers + 1e-9))
    if count and layer_scores is None:
        raise RepairUnavailableError(
            "choosing layer blocks needs per-layer scores from the mapping's metrics")
    return choose_blocks(layer_scores or [], count) if count else ()


@dataclass(frozen=True)
class _TokenSlots:
    """How a plan fills token slots on an ``n``-token document: the sinks, interior tokens, the tail."""

    n: int
    sink_tokens: int
    scattered_share: float
    importance: torch.Tensor | None
    """The source's attention ranking of interior tokens; None plans no interior tokens."""

    def choose(self, k: int) -> tuple[tuple[int, ...], int, int]:
        """The plan of ``k`` token slots: (positions, tail length, sink count)."""
        n, importance = self.n, self.importance
        sink = min(self.sink_tokens, k, n)
        rest = k - sink
        scattered_n = int(rest * self.scattered_share) if importance is not None else 0
        tail_n = min(rest - scattered_n, n - sink)
        chosen = set(range(sink)) | set(range(n - tail_n, n))
        if scattered_n:
            assert importance is not None  # scattered slots are only planned with an importance ranking
            ranked = importance[: n - tail_n].clone()
            ranked[:sink] = -math.inf
            for p in ranked.topk(min(scattered_n, max(0, n - tail_n - sink))).indices.tolist():
                chosen.add(int(p))
        return tuple(sorted(chosen)), tail_n, sink


def _slot_count(slots: _TokenSlots, model: CostModel | None, done: set[int], block_share: float,
                budget: float) -> int:
    """The most token slots whose plan, with ``done`` and the blocks' ``block_share``, fits ``budget``."""
    n = slots.n
    if model is None:
        return max(0, int(math.floor((budget - block_share) * n + 1e-9)))

    def fits(k: int) -> bool:
        return model.share(n, sorted(done.union(slots.choose(k)[0]))) + block_share <= budget + 1e-12

    # The largest k that fits: a full recompute (one prefill) is checked first, since a plan one token short
    # of it (sinks and tail split by a gap) costs more; below it the cost grows with k.
    if fits(n):
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class _ComputeModel(CostModel):
    """A target's multiply-adds per token and layer: ``linear`` (projections and MLP) + ``attention`` per key."""

    linear: int
    attention: int
    layers: int
    flash: bool = False
    kind: str = "compute"

    @classmethod
    def of(cls, config: ModelConfig | None) -> _ComputeModel | None:
        """From a model config; None when it lacks the usual sizes (hidden, heads, intermediate, layers)."""
        if config is None:
            return None
        try:
            d, heads = int(config.hidden_size), int(config.num_attention_heads)
            kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
            head_dim = int(getattr(config, "head_dim", None) or d // heads)
            inter, layers = int(config.intermediate_size), int(config.num_hidden_layers)
        except (AttributeError, TypeError, ValueError):
            return None
        flash = "flash" in str(getattr(config, "_attn_implementation", None) or "")
        return cls(2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + 3 * d * inter, 2 * heads * head_dim,
                   layers, flash)

    def share(self, n: int, tokens: Sequence[int]) -> float:
        """The passes recomputing ``tokens`` of an ``n``-token cache, as a share of its causal prefill."""
        from mappings.recompute import token_passes

        prefill = n * self.linear + self.attention * n * (n + 1) / 2
        # A pass over a cut cache scores a dense block (the kernel gets a mask); one from scratch is a causal prefill.
        spent = sum(q * self.linear + self.attention * (q * (past + q) if past else q * (q + 1) / 2)
                    for q, past in token_passes(n, tokens, flash=self.flash))
        return spent / prefill


def compute_share(config: ModelConfig | None, n: int, tokens: Sequence[int], block_layers: int = 0) -> float | None:
    """Multiply-adds of a repair as a fraction of the model's causal prefill of ``n`` tokens, counting attention.

    Per layer, a token costs its projections and MLP plus ``2 * heads * head_dim`` per key it
    scores. A prefill token scores ``p + 1`` keys (``n / 2`` on average); a repair pass over a cut
    cache (:func:`mappings.recompute.token_passes`) scores its queries against every key it holds,
    about ``n`` for a tail token, and a pass from position 0 is a causal prefill of its own.
    ``block_layers`` whole layers add ``block_layers / L``. The LM head is left out on both sides
    (a prefill that is continued keeps only its last logits). None when ``config`` lacks the usual
    sizes (hidden, heads, intermediate, layers). This is the measure of a policy's budget and a
    plan's ``cost``.
    """
    model = _ComputeModel.of(config)
    if model is None:
        return None
    return model.share(n, tokens) + block_layers / model.layers


def attention_importance(model: Model, layers: KVLayers, input_ids: torch.Tensor, probe_tokens: int = 16,
                         focus: Sequence[int] | None = None) -> torch.Tensor:
    """How much ``model``'s last ``probe_tokens`` tokens attend to each position, ``[n]``.

    Re-runs the last tokens over ``layers`` (the model's own cache of ``input_ids``, cut before
    them) capturing their queries, then averages the softmax attention over probes, heads and
    layers. Cost: ``probe_tokens`` tokens of a forward pass. With ``focus`` (token ids that follow
    the document: an agent's question), those tokens are run after the whole cache instead and
    their attention on the document's positions ranks them (cost: ``len(focus)`` tokens).
    """
    import torch

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    n = input_ids.shape[1]
    if focus:
        ids = torch.tensor([list(focus)], dtype=torch.long, device=layers[0][0].device)
        return _attention_on_document(model, layers, ids, n, n)
    t = max(1, min(probe_tokens, n - 1))
    return _attention_on_document(model, layers, input_ids[:, n - t :], n - t, n)


def _attention_on_document(model: Model, layers: KVLayers, ids: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """How much ``ids``, run at positions ``start...`` over ``layers`` cut at ``start``, attend to each of the first
    ``n`` positions, ``[n]``: softmax over those keys, averaged over the queries, heads and layers."""
    import torch

    from mappings.cache_io import build_cache, forward_with_cache, slice_layers
    from mappings.capture import capture_queries
    from mappings.metrics import attention_received
    from mappings.rope import RopeSpec

    t = ids.shape[1]
    positions = torch.arange(start, start + t)
    with capture_queries(model) as queries:
        forward_with_cache(model, ids, build_cache(slice_layers(layers, 0, start), model.config),
                           position_ids=positions[None].to(ids.device), logits_to_keep=1)
    rope = RopeSpec.from_config(model.config)
    total = torch.zeros(n)
    for i, (k, _v) in enumerate(layers):
        d = k.shape[-1]
        q = queries[i].float()
        q = q.reshape(q.shape[0], t, -1, d).transpose(1, 2)  # [B, H, t, d]
        q = rope.apply(q, positions.to(q.device))
        # the softmax is over the document's keys alone: a focus's attention on its own tokens says nothing of
        # which document tokens it reads
        total += attention_received(q[:1], k[:1, :, :n], positions).mean(dim=(0, 1)).cpu()
    return total / len(layers)


def _rank(source: Model | None, source_layers: KVLayers | None, input_ids: torch.Tensor, probe_tokens: int,
          seconds: dict[str, float], focus: Sequence[int] | None = None) -> torch.Tensor:
    """The source's attention ranking for scattered tokens (its seconds under ``rank``); both repair paths use it."""
    if source is None or source_layers is None:
        raise RepairUnavailableError("scattered token repair ranks tokens by the source's attention: pass "
                                     "source= and source_layers=, or importance=")
    t0 = time.perf_counter()
    importance = attention_importance(source, source_layers, input_ids, probe_tokens, focus)
    seconds["rank"] = time.perf_counter() - t0
    return importance

def repair_cache(
    target: Model,
    mapped: KVLayers,
    input_ids: torch.Tensor,
    policy: RepairPolicy,
    *,
    layer_scores: Sequence[float] | None = None,
    residual: ResidualMap | None = None,
    source_hidden: dict[int, torch.Tensor] | None = None,
    source: Model | None = None,
    source_layers: KVLayers | None = None,
    importance: torch.Tensor | None = None,
    keep_logits: int = 0,
    costs: CostModel | None = None,
    exact: int = 0,
) -> RepairResult:
    """Apply ``policy`` to a mapped cache of ``input_ids`` on ``target``; returns the repaired layers.

    Layer blocks starting after layer 0 need ``residual`` maps and the source hidden states they
    read (``source_hidden[s]``: the state entering source layer ``s``, ``[batch, n, d]``).
    Scattered tokens need ``source`` and its own cache ``source_layers`` to rank positions, or
    the ranking itself (``importance``: `attention_importance` of the source, computed elsewhere).
    Blocks run first, then the chosen tokens are recomputed over the result
    (:func:`mappings.recompute.repair_tokens`). ``keep_logits``: also recompute the last
    ``keep_logits`` positions (if the plan's tail does not cover them) and return their logits in
    ``result.logits``, e.g. for a probe. ``mapped`` is never modified. An adaptive policy needs a
    probe to climb against: :func:`climb_repair`. ``costs`` and ``exact``: as :func:`plan_repair`.
    """
    from mappings.cache_io import sync_device
    from mappings.recompute import repair_tokens_and_logits

    if policy.adaptive:
        raise RepairUnavailableError("an adaptive policy (ladder) climbs against a probe: use climb_repair, or "
                                     "policy.at(budget) for one fixed budget")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    n, num_layers = input_ids.shape[1], len(mapped)
    seconds: dict[str, float] = {}
    if policy.budget and policy.scattered_share and importance is None:
        importance = _rank(source, source_layers, input_ids, policy.probe_tokens, seconds, policy.focus_ids)
    plan = plan_repair(policy, n, num_layers, layer_scores=layer_scores, importance=importance,
                       config=getattr(target, "config", None), costs=costs, exact=exact)
    layers = list(mapped)
    if plan.blocks:
        t0 = time.perf_counter()
        _recompute_blocks(target, layers, input_ids, plan.blocks, residual, source_hidden)
        sync_device(layers[0][0].device)
        seconds["layers"] = time.perf_counter() - t0
    logits = None
    if plan.tokens or keep_logits:
        t0 = time.perf_counter()
        layers, logits = repair_tokens_and_logits(target, layers, input_ids, plan.tokens, logits=keep_logits)
        sync_device(layers[0][0].device)
        seconds["tokens"] = time.perf_counter() - t0
    return RepairResult(layers, plan, policy, seconds, logits=logits)


def _recompute_blocks(target: Model, layers: KVLayers, input_ids: torch.Tensor,
                      blocks: Sequence[tuple[int, int]], residual: ResidualMap | None,
                      source_hidden: dict[int, torch.Tensor] | None) -> None:
    """Nothing: writes the target's own K/V of every block into ``layers``, run from the state entering it."""
    from mappings.recompute import embed, run_layers

    for a, z in blocks:
        if a == 0:
            hidden = embed(target, input_ids)
        else:
            hidden = _mapped_hidden(a, z, residual, source_hidden).to(layers[0][0].dtype)
        _, kv = run_layers(target, hidden, a, z)
        for j, pair in enumerate(kv):
            layers[a + j] = (pair[0].to(layers[a + j][0].dtype), pair[1].to(layers[a + j][1].dtype))


def _mapped_hidden(a: int, z: int, residual: ResidualMap | None,
                   source_hidden: dict[int, torch.Tensor] | None) -> torch.Tensor:
    """The state entering target layer ``a`` (block ``[a, z)``), mapped from the source's residual stream."""
    if residual is None or source_hidden is None:
        raise RepairUnavailableError(
            f"layer block [{a}, {z}) starts after layer 0: it needs the mapping's residual maps "
            "(add them with `orchestra calibrate-repair --mapping DIR --corpus FILE`) and the "
            "source's hidden states"
        )
    s = residual.layers[a].source
    if s not in source_hidden:
        raise RepairUnavailableError(f"source hidden state entering layer {s} was not captured")
    return residual.apply(a, source_hidden[s])


def climb_repair(
    target: Model,
    mapped: KVLayers,
    input_ids: torch.Tensor,
    policy: RepairPolicy,
    probe: Probe,
    *,
    tail: int,
    importance: torch.Tensor | None = None,
    source: Model | None = None,
    source_layers: KVLayers | None = None,
    costs: CostModel | None = None,
    exact: int = 0,
) -> RepairResult:
    """Adaptive repair: the smallest budget of ``policy.rungs`` whose cache passes ``probe``.

    The first rung (``policy.budget``, 0 for the pure map) recomputes its plan and the last
    ``tail`` tokens, whose logits go to ``probe``. While the probe fails, the next rung recomputes
    only the positions its plan adds (repaired positions stay repaired) plus the ``tail`` probe
    tokens again (the only positions recomputed more than once: their logits must see the new
    repairs), and probes again. A rung that adds no position is skipped. The climb stops at the
    first pass, at the end of the ladder, or before a rung that would bring the spend past
    ``policy.max_spend``. Spend: the compute of the rungs' passes beyond the first probe (which a
    pure map pays anyway), as a share of a prefill (a re-prefill is 1), measured as the budget is
    (:func:`compute_share` from the target's config; the token share without it).

    Returns the last rung's cache and probe logits; ``result.ladder`` records each rung
    (budget, positions recomputed, passed, the probe's metrics), ``passed`` (the budget that
    passed, None if none did), ``spent`` (compute share), ``token_share`` (positions recomputed
    beyond the first probe / n), ``recomputed`` (positions fed to the target in all), ``repaired``
    (distinct positions repaired outside the probe tokens) and ``stopped`` (why the climb ended
    without a pass). ``mapped`` is never modified; scattered tokens are ranked (as in
    :func:`repair_cache`) only when a rung above 0 needs them. ``costs`` prices the rungs (as
    :func:`plan_repair`); the first ``exact`` positions are already exact and never recomputed.
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    climb = _start_climb(target, input_ids, policy, probe, tail=tail, num_layers=len(mapped), costs=costs,
                         exact=exact)
    state = _ClimbState(list(mapped), set(climb.given))
    for i, budget in enumerate(policy.rungs):
        if budget and policy.scattered_share and importance is None:
            importance = _rank(source, source_layers, input_ids, policy.probe_tokens, state.seconds,
                               policy.focus_ids)
        if _climb_rung(climb, state, i, budget, importance):
            break
    else:
        state.stopped = "no budget of the ladder passed the probe"
    return _climb_result(climb, state)


@dataclass(frozen=True)
class _Climb:
    """What every rung of one ladder climb shares: target, document, policy, probe and pricing."""

    target: Model
    input_ids: torch.Tensor
    policy: RepairPolicy
    probe: Probe
    tail: int
    num_layers: int
    exact: int
    config: ModelConfig | None
    model: CostModel | None
    probe_pos: frozenset[int]
    given: frozenset[int]
    """The sinks: exact already, never recomputed."""
    first_probe: float
    """The first rung's probe pass, which the pure map pays anyway (left out of the spend)."""

    @property
    def n(self) -> int:
        """The document's length in tokens."""
        return int(self.input_ids.shape[1])

    def share(self, positions: Collection[int]) -> float:
        """One rung's pass (its new positions with the probe tokens) as a share of a prefill."""
        return _pass_share(self.model, self.n, positions)


def _pass_share(model: CostModel | None, n: int, positions: Collection[int]) -> float:
    """A pass over ``positions`` of an ``n``-token cache as a share of a prefill (token share if no model)."""
    return model.share(n, sorted(positions)) if model is not None else len(positions) / n


def _start_climb(target: Model, input_ids: torch.Tensor, policy: RepairPolicy, probe: Probe, *, tail: int,
                 num_layers: int, costs: CostModel | None, exact: int) -> _Climb:
    """The climb's shared context, once the probe's ``tail`` tokens are known to fit the document."""
    n = input_ids.shape[1]
    if not 1 <= tail <= n:
        raise ShapeMismatchError(f"cannot probe the last {tail} tokens of a {n}-token prefix")
    probe_pos = frozenset(range(n - tail, n))
    config = getattr(target, "config", None)
    model = costs if costs is not None else _ComputeModel.of(config)
    first_probe = _pass_share(model, n, probe_pos)
    given = frozenset(range(min(max(0, exact), n - tail)))
    return _Climb(target, input_ids, policy, probe, tail, num_layers, exact, config, model, probe_pos, given,
                  first_probe)


@dataclass
class _ClimbState:
    """Where a climb stands: its working layers, what its rungs recomputed and spent, and how it ended."""

    layers: KVLayers
    repaired: set[int]
    seconds: dict[str, float] = field(default_factory=lambda: {"tokens": 0.0})
    steps: list[LadderStep] = field(default_factory=list)
    owned: bool = False
    """The working layers are this climb's own fresh tensors (a rung may then repair them in place)."""
    spent: float = 0.0
    recomputed: int = 0
    passed: float | None = None
    stopped: str | None = None
    plan: RepairPlan | None = None
    logits: torch.Tensor | None = None


def _climb_rung(climb: _Climb, state: _ClimbState, i: int, budget: float,
                importance: torch.Tensor | None) -> bool:
    """True when the climb ends at rung ``i``: its probe passed, or it would overspend (see ``state``)."""
    rung = plan_repair(climb.policy.at(budget), climb.n, climb.num_layers, importance=importance,
                       config=climb.config, costs=climb.model, exact=climb.exact)
    new = sorted(set(rung.tokens) - state.repaired - climb.probe_pos)
    if i and not new:
        state.steps.append(LadderStep(budget=budget, tokens=0, skipped=True))
        return False
    # The first probe is the map's own tail: the pure map pays it too.
    cost = climb.share(set(new) | climb.probe_pos) - (0.0 if i else climb.first_probe)
    if i and state.spent + cost > climb.policy.max_spend + 1e-12:
        state.stopped = (f"the {budget:.0%} rung would bring the repair spend to {state.spent + cost:.1%} "
                         f"of a prefill, over max_spend {climb.policy.max_spend:.0%}")
        return True
    logits = _recompute_rung(climb, state, new)
    state.repaired.update(new)
    state.spent += cost
    state.recomputed += len(new) + climb.tail
    state.plan = rung
    ok, metrics = climb.probe(logits)
    state.steps.append(LadderStep(budget=budget, tokens=len(new) + climb.tail, passed=bool(ok),
                                  metrics={k: float(v) for k, v in metrics.items()}))
    if ok:
        state.passed = budget
    return bool(ok)


def _recompute_rung(climb: _Climb, state: _ClimbState, new: Sequence[int]) -> torch.Tensor:
    """The probe tokens' logits, once ``new`` and they are recomputed over the climb's working layers."""
    from mappings.cache_io import sync_device
    from mappings.recompute import repair_tokens_and_logits

    t0 = time.perf_counter()
    state.layers, state.logits = repair_tokens_and_logits(climb.target, state.layers, climb.input_ids, new,
                                                          logits=climb.tail, in_place=state.owned)
    assert state.logits is not None  # tail >= 1 always asks for logits
    sync_device(state.layers[0][0].device)
    state.seconds["tokens"] += time.perf_counter() - t0
    state.owned = True  # from here on the working layers are this climb's own fresh tensors
    return state.logits


def _climb_result(climb: _Climb, state: _ClimbState) -> RepairResult:
    """The last rung's cache and probe logits, with the ladder's record of the climb."""
    assert state.plan is not None and state.logits is not None  # the first rung always runs
    ladder = RepairLadder(budgets=list(climb.policy.rungs), passed=state.passed, spent=state.spent,
                          token_share=(state.recomputed - climb.tail) / climb.n, recomputed=state.recomputed,
                          repaired=len(state.repaired - climb.given), probe_tokens=climb.tail,
                          stopped=state.stopped, steps=state.steps)
    return RepairResult(state.layers, state.plan, climb.policy, state.seconds, logits=state.logits,
                        ladder=ladder)
