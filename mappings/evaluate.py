"""The honest table: how close does a mapped cache bring the target to its own prefill?

For a document, the first ``N`` tokens become the cache (re-prefilled by the target as the
truth, or prefilled by the source and mapped), the next ``M`` tokens are fed as real input, and
the target's next-token distributions over those ``M`` positions are compared with the truth:

- ``kl``: mean ``KL(p_true || p_method)`` (nats); ``top1``: argmaxes agree; ``top5``: the true
  argmax is in the method's top 5; ``nll_delta``: mean NLL difference on the document's own next
  tokens; ``greedy_agreement``: greedy tokens generated after the suffix until the first one that
  differs from the truth's (out of ``greedy_tokens``);
- ``map_seconds``: producing the target cache from the source cache; ``prefill_seconds``: target
  forward passes spent on the prefix (the whole prefix for ``reprefill``, the tail for ``+tail``,
  the repair for ``+repair``);
- ``cost_fraction`` (planned), ``token_share`` and ``measured_cost``: target compute as a fraction
  of the target's own prefill of the same prefix, planned (what a repair budget bounds: the passes
  priced by the target's timed pass costs, :mod:`mappings.passcost`, or by their multiply-adds
  counting attention, :func:`mappings.repair.compute_share`), the plan's size (recomputed tokens /
  prefix + layers / layers) and measured (seconds / that prefill's seconds in the same window). The
  reference prefill keeps only its last position's logits, as a prefill that is continued does.

Methods: ``reprefill`` (truth), ``identity`` (source KV unchanged, identical layouts only),
``ridge`` / ``anchored`` / ``perhead_rope`` (refitted from the mapping's stored plain calibration
statistics), the mapping's own method as a pure map, ``+sinks<k>`` (its first ``k`` positions
exact: what a FamilyCache serves), and tail-recompute variants. The own tail row, the repair rows
and the layer curves start from the served cache (mapped once, shared by every row). Single-layer
replacement (one layer mapped, the rest true) and error accumulation (layers ``0..k`` mapped) are
reported per layer for the mapping's own method.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from mappings.calibrate import _with_overrides
from mappings.errors import DocumentTooLongError, DocumentTooShortError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
    from transformers.cache_utils import Cache

    from mappings.apply import LinearKVMap
    from mappings.cache_io import KVLayers
    from mappings.models import ModelHandle
    from mappings.passcost import PassCosts
    from mappings.repair import RepairPolicy
    from mappings.store import Mapping

__all__ = ["EvaluationSettings", "MethodResult", "LayerCurvePoint", "EvaluationReport", "evaluate", "write_report",
           "plot_layer_curves", "BASELINES"]

BASELINES = ("identity", "ridge", "anchored", "perhead_rope")


@dataclass(frozen=True)
class EvaluationSettings:
    """What an evaluation scores and how: the spans, the rows beside the pure maps, how costs are priced.

    ``evaluate(mapping, document, EvaluationSettings(prefix_tokens=256))``; every field also reads as a keyword of
    :func:`evaluate` (``evaluate(mapping, document, prefix_tokens=256)``), applied over the settings given.
    """

    prefix_tokens: int = 1024
    """Document tokens carried as a (mapped) cache."""
    suffix_tokens: int = 32
    """Following tokens fed as real input and scored against the target's own prefill."""
    windows: int = 1
    """Consecutive spans of ``prefix_tokens + suffix_tokens`` from the start of the document, scored and averaged."""
    tail_tokens: int = 64
    """Tail rows ``<method>+tail<k>`` recompute this many last prefix tokens (0: no tail rows)."""
    sink_tokens: int = 4
    """A row ``<method>+sinks<k>``: the map with its first ``k`` positions the target's own (what a FamilyCache
    serves by default; 0: no such row), at least the mapping method's ``exact_sinks``."""
    greedy_tokens: int = 64
    """Greedy tokens compared after the suffix (0: skip)."""
    baselines: Sequence[str] = BASELINES
    """Baseline rows: ``identity`` and methods refitted on the mapping's stored calibration statistics."""
    layer_curves: bool = True
    """Score single-layer replacement and error accumulation curves."""
    repairs: Sequence[RepairPolicy] = ()
    """Map-then-repair policies, scored as extra rows ``<method>+repair@<budget>``."""
    repair_costs: Literal["measured", "compute"] = "measured"
    """How the repair rows' budgets and every row's planned cost are priced: ``measured`` (the target's timed
    passes on this machine, kept in ``pass-costs/`` beside the mapping) or ``compute`` (multiply-adds)."""
    timing_repeats: int = 2
    """The reference prefill and every repair are timed as the fastest of this many runs."""
    device: str = "cpu"
    """Torch device the models (given as folders) and the mapping are loaded on."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "baselines", tuple(self.baselines))  # frozen all the way down
        object.__setattr__(self, "repairs", tuple(self.repairs))
        if int(self.timing_repeats) < 1:
            raise ValueError(f"timing_repeats is at least 1, not {self.timing_repeats}")
        if self.repair_costs not in ("measured", "compute"):
            raise ValueError(f"repair_costs is 'measured' or 'compute', not {self.repair_costs!r}")


class _Row(TypedDict):
    """One method's scores in one window: metrics, seconds, costs and the repair's summary, averaged by
    _method_results."""

    kl: float
    top1: float
    top5: float
    nll_delta: float
    map_seconds: float
    prefill_seconds: float
    cost: float | None
    repair: dict[str, object] | None
    tokens: float | None
    measured: float
    greedy: int | None


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MethodResult(_Model):
    """One row of the table."""

    method: str
    kl: float = Field(description="mean KL(target's own prefill || method) over the suffix, nats")
    top1: float = Field(description="fraction of suffix positions whose argmax agrees with the truth")
    top5: float = Field(description="fraction where the truth's argmax is in the method's top 5")
    nll_delta: float | None = Field(description="mean NLL(method) - NLL(truth) of the document's next tokens")
    map_seconds: float = Field(description="seconds to produce the target cache from the source cache")
    prefill_seconds: float = Field(description="seconds of target forward passes spent on the prefix")
    greedy_agreement: float | None = Field(
        default=None, description="greedy tokens generated before the first divergence (mean over windows)"
    )
    greedy_tokens: int = Field(default=0, description="greedy tokens compared")
    cost_fraction: float | None = Field(
        default=None,
        description="planned target compute as a fraction of a full prefill: 1 for reprefill, 0 for pure maps; "
        "for repairs and tail variants the passes' multiply-adds counting attention (mappings.repair."
        "compute_share; the token share when the target's sizes are unknown), what a repair budget bounds",
    )
    token_share: float | None = Field(
        default=None,
        description="recomputed tokens / prefix + recomputed layers / layers (1 for reprefill, 0 for pure maps): "
        "the plan's size, below cost_fraction when late tokens score more keys than an average prefill token",
    )
    measured_cost: float | None = Field(
        default=None,
        description="seconds the target spent on the prefix (re-prefill, tail recompute, or repair of layers and "
        "tokens; not the source's ranking of scattered tokens) / the target's own prefill seconds in the same "
        "window, averaged over windows: the number to hold against cost_fraction",
    )
    # JSON of the repair record (readers index into it: r.repair["policy"]["budget"])
    repair: dict[str, Any] | None = Field(
        default=None, description="repair rows: the policy and its plan (tokens, tail, blocks)"
    )


class LayerCurvePoint(_Model):
    """KL when some layers are mapped and the others are the target's own."""

    layer: int
    kl: float
    top1: float


class EvaluationReport(_Model):
    """Everything ``orchestra evaluate`` prints and writes."""

    mapping: str | None
    mapping_method: str
    # {"path": str | None, "fingerprint": {...}}: readers index into them
    source: dict[str, Any] = Field(description="path and fingerprint of the source")
    target: dict[str, Any] = Field(description="path and fingerprint of the target")
    document: dict[str, object] = Field(description="name, sha256 and token counts of the document")
    prefix_tokens: int
    suffix_tokens: int
    windows: int = Field(default=1, description="document windows averaged")
    tail_tokens: int
    reference_prefill_seconds: float = Field(description="target prefill of the prefix")
    source_prefill_seconds: float = Field(description="source prefill of the prefix (paid once, shared)")
    methods: list[MethodResult]
    skipped: dict[str, str] = Field(default_factory=dict, description="methods not run, and why")
    single_layer: list[LayerCurvePoint] = Field(default_factory=list, description="only layer i mapped")
    accumulation: list[LayerCurvePoint] = Field(default_factory=list, description="layers 0..i mapped")
    plots: list[str] = Field(default_factory=list)
    pass_costs: dict[str, object] | None = Field(
        default=None, description="the target's measured pass costs that priced the plans (None: multiply-adds)")

    def row(self, method: str) -> MethodResult:
        for r in self.methods:
            if r.method == method:
                return r
        raise KeyError(method)


def _greedy(model: PreTrainedModel, cache: Cache, first_logits: torch.Tensor, steps: int) -> list[int]:
    from mappings.cache_io import forward_with_cache

    tokens: list[int] = []
    nxt = first_logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        tokens.append(int(nxt[0, 0]))
        if len(tokens) == steps:
            break
        logits, cache, _ = forward_with_cache(model, nxt, cache)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
    return tokens


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _baseline_maps(mapping: Mapping, names: Sequence[str], identical_layout: bool, source_config: PretrainedConfig,
                   target_config: PretrainedConfig) -> tuple[dict[str, LinearKVMap], dict[str, str]]:
    from mappings.apply import identity_map
    from mappings.assemble import fit_kv_map
    from mappings.methods import METHODS

    maps: dict[str, LinearKVMap] = {}
    skipped: dict[str, str] = {}
    km = mapping.kv_map
    s, t = km.source_shape, km.target_shape
    plan = [lm.sources for lm in km.layers]
    for name in names:
        if name == "identity":
            if identical_layout:
                maps[name] = identity_map(source_config, target_config)
            else:
                skipped[name] = "source and target cache layouts differ: the source KV cannot be reused unchanged"
            continue
        if name == mapping.manifest.method.name:
            continue  # the mapping's own row covers it
        spec = METHODS[name]
        if spec.needs_same_shape and (s.kv_heads, s.head_dim) != (t.kv_heads, t.head_dim):
            skipped[name] = "needs equal KV heads and head size"
            continue
        if spec.granularity == "head" and s.kv_heads != t.kv_heads:
            skipped[name] = "needs equal KV head counts"
            continue
        if mapping.stats is None:
            skipped[name] = "the mapping was saved without calibration statistics"
            continue
        maps[name] = fit_kv_map(mapping.stats, spec, plan, s, t, km.source_rope, km.target_rope)
    return maps, skipped


def evaluate(
    mapping: Mapping | str | Path,
    document: str | Sequence[int],
    settings: EvaluationSettings | None = None,
    *,
    source: str | Path | ModelHandle | PreTrainedModel | None = None,
    target: str | Path | ModelHandle | PreTrainedModel | None = None,
    document_name: str = "document",
    progress: bool = False,
    **overrides: object,
) -> EvaluationReport:
    """Evaluate a mapping (directory or loaded) on one document (text, or token ids); see the module docstring.

    ``settings`` says what is scored and how (:class:`EvaluationSettings`; None: its defaults); any of its fields
    may be given as a keyword instead, over ``settings`` (``evaluate(mapping, text, prefix_tokens=256)``), and a
    keyword that is no field is a TypeError. ``source``/``target`` default to the model folders recorded in the
    manifest; their fingerprints are checked against the mapping (:class:`StaleMappingError`).
    ``document_name`` names the document in the report and in errors; ``progress``: a bar over the windows.

    ``windows`` consecutive spans of ``prefix_tokens + suffix_tokens`` from the start of the document are scored
    and averaged. The tail, repair and layer-curve rows start from the served cache (the map with its sinks exact),
    as a FamilyCache's paths do. With ``repair_costs="measured"`` the repair rows' budgets and every row's planned
    ``cost`` are priced by the target's timed passes (:func:`mappings.passcost.load_or_measure`, as a FamilyCache
    prices them); timings are only taken when there are repair rows, and without them every planned cost is in
    compute (the report's ``pass_costs`` is None). ``timing_repeats``: on a shared machine one run can take twice
    as long as the next, and a measured cost is a ratio of two such timings.
    """
    cfg = _with_overrides(EvaluationSettings, settings, overrides, "evaluate")
    mapping, mapping_dir, src, tgt = _load_pair(mapping, source, target, cfg.device)
    ids_all, doc_sha = _document_ids(document, tgt.tokenizer)
    n, m, windows = int(cfg.prefix_tokens), int(cfg.suffix_tokens), int(cfg.windows)
    _check_spans(len(ids_all), n, m, windows, cfg.greedy_tokens, document_name, src.model, tgt.model)
    ctx, skipped = _eval_context(cfg, mapping, mapping_dir, src, tgt)
    per_window = _evaluate_windows(ctx, ids_all, windows, progress)
    document_record: dict[str, object] = {"name": document_name, "sha256": doc_sha, "tokens": len(ids_all)}
    return _report(ctx, _Subject(mapping_dir, src, tgt, document_record), per_window, skipped)


def _eval_context(cfg: EvaluationSettings, mapping: Mapping, mapping_dir: Path | None, src: ModelHandle,
                  tgt: ModelHandle) -> tuple[_EvalContext, dict[str, str]]:
    """What every window runs (rows, maps, spans, pass costs), and the rows this pair skips with why."""
    n, m = int(cfg.prefix_tokens), int(cfg.suffix_tokens)
    tail = max(0, min(int(cfg.tail_tokens), n - 1))
    costs = _repair_pass_costs(cfg.repairs, cfg.repair_costs, mapping_dir, tgt)
    maps, skipped = _methods(mapping, cfg.baselines, src.model.config, tgt.model.config)
    own = mapping.manifest.method.name
    ctx = _EvalContext(
        source=src.model, target=tgt.model, mapping=mapping, maps=maps,
        order=[b for b in cfg.baselines if b in maps] + ([own] if own not in cfg.baselines else []),
        tail_rows=([own] + (["identity"] if "identity" in maps else [])) if tail else [],
        n=n, m=m, tail=tail,
        # A mapping fitted with exact sinks is only ever served with them (FamilyCache makes at least that many exact)
        sinks=max(int(cfg.sink_tokens), mapping.manifest.method.exact_sinks),
        greedy_tokens=cfg.greedy_tokens, layer_curves=cfg.layer_curves, repairs=cfg.repairs, costs=costs,
        timing_repeats=int(cfg.timing_repeats) if cfg.repairs else 1,
    )
    return ctx, skipped


def _evaluate_windows(ctx: _EvalContext, ids_all: Sequence[int], windows: int,
                      progress: bool) -> list[_Window]:
    """The results of each of the first ``windows`` consecutive ``n + m`` spans of the document, in order."""
    import torch
    from tqdm.auto import tqdm

    n, m = ctx.n, ctx.m
    per_window: list[_Window] = []
    bar = tqdm(total=windows, desc="evaluating windows", disable=not progress)
    for w in range(windows):
        span = torch.tensor(ids_all[w * (n + m) : w * (n + m) + n + m + 1])[None]
        per_window.append(_evaluate_window(ctx, span))
        bar.update(1)
    bar.close()
    return per_window


@dataclass(frozen=True)
class _Subject:
    """What an evaluation's report names: the mapping's folder, both models and the document."""

    mapping_dir: Path | None
    source: ModelHandle
    target: ModelHandle
    document: dict[str, object]
    """Its name, sha256 and token count."""


def _report(ctx: _EvalContext, subject: _Subject, per_window: Sequence[_Window],
            skipped: dict[str, str]) -> EvaluationReport:
    """The evaluation's report: every row and layer curve averaged over the windows, with what was scored."""
    src, tgt = subject.source, subject.target
    return EvaluationReport(
        mapping=str(subject.mapping_dir) if subject.mapping_dir is not None else None,
        mapping_method=ctx.own,
        source={"path": str(src.path) if src.path else None, "fingerprint": src.fingerprint.as_dict()},
        target={"path": str(tgt.path) if tgt.path else None, "fingerprint": tgt.fingerprint.as_dict()},
        document=subject.document,
        prefix_tokens=ctx.n, suffix_tokens=ctx.m, windows=len(per_window), tail_tokens=ctx.tail,
        reference_prefill_seconds=_mean([pw.ref_seconds for pw in per_window]),
        source_prefill_seconds=_mean([pw.src_seconds for pw in per_window]),
        methods=_method_results(per_window, ctx.greedy_tokens), skipped=skipped,
        single_layer=_layer_curve([pw.single for pw in per_window]),
        accumulation=_layer_curve([pw.accum for pw in per_window]),
        pass_costs=None if ctx.costs is None else _pass_cost_summary(ctx.costs, ctx.n),
    )


def _load_pair(mapping: Mapping | str | Path, source: str | Path | ModelHandle | PreTrainedModel | None,
               target: str | Path | ModelHandle | PreTrainedModel | None,
               device: str) -> tuple[Mapping, Path | None, ModelHandle, ModelHandle]:
    """The mapping, its folder (None for one built in memory) and its two models, fingerprints checked."""
    from mappings.fingerprint import check_fingerprints
    from mappings.models import load_model
    from mappings.store import load_mapping, read_manifest

    mapping_dir = None
    if isinstance(mapping, (str, Path)):
        mapping_dir = Path(mapping)
        manifest = read_manifest(mapping_dir)
    else:
        manifest = mapping.manifest
        mapping_dir = mapping.path
    source = source if source is not None else manifest.source.path
    target = target if target is not None else manifest.target.path
    if source is None or target is None:
        raise ValueError("the mapping does not record model folders: pass source= and target=")
    src = load_model(source, device=device)
    tgt = load_model(target, device=device)
    if isinstance(mapping, (str, Path)):
        mapping = load_mapping(mapping, src.fingerprint, tgt.fingerprint, device=device, with_stats=True)
    else:
        check_fingerprints(mapping.manifest, src.fingerprint, tgt.fingerprint)
    return mapping, mapping_dir, src, tgt


def _repair_pass_costs(repairs: Sequence[RepairPolicy], repair_costs: str, mapping_dir: Path | None,
                       tgt: ModelHandle) -> PassCosts | None:
    """The target's timed pass costs that price the repair rows, or None: priced in compute."""
    if repair_costs != "measured" or not repairs:  # timing a target (a minute on CPU) pays only where budgets need it
        return None
    from mappings.passcost import load_or_measure

    where = Path(mapping_dir).parent / "pass-costs" if mapping_dir is not None else None
    return load_or_measure(tgt.model, tgt.fingerprint.combined, where)


def _methods(mapping: Mapping, baselines: Sequence[str], source_config: PretrainedConfig,
             target_config: PretrainedConfig) -> tuple[dict[str, LinearKVMap], dict[str, str]]:
    """The map of every baseline this pair allows and the mapping's own, and why the others were skipped."""
    from mappings.capture import kv_shape

    identical = kv_shape(source_config) == kv_shape(target_config)
    maps, skipped = _baseline_maps(mapping, [b for b in baselines if b != "reprefill"], identical,
                                   source_config, target_config)
    maps[mapping.manifest.method.name] = mapping.kv_map
    return maps, skipped


def _document_ids(document: str | Sequence[int], tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], str]:
    """The document's token ids and the sha256 the report identifies it by (of its text, or of its ids)."""
    if isinstance(document, str):
        sha = hashlib.sha256(document.encode("utf-8")).hexdigest()
        return tokenizer(document, add_special_tokens=False)["input_ids"], sha
    ids_all = list(document)
    return ids_all, hashlib.sha256(",".join(map(str, ids_all)).encode()).hexdigest()


def _check_spans(tokens: int, n: int, m: int, windows: int, greedy_tokens: int, document_name: str,
                 source: PreTrainedModel, target: PreTrainedModel) -> None:
    """Refuse windows the document cannot fill, or spans past a model's positions, before any forward pass."""
    if n < 1 or m < 1 or windows < 1:
        raise ValueError("prefix, suffix and windows need to be at least 1")
    if tokens < windows * (n + m):
        raise DocumentTooShortError(
            f"{document_name} has {tokens} tokens, the evaluation needs {windows} window(s) of prefix {n} + "
            f"suffix {m}: pass a longer document or lower --prefix-tokens / --suffix-tokens / --windows"
        )
    need = n + m + greedy_tokens
    for side, model in (("source", source), ("target", target)):
        limit = getattr(model.config, "max_position_embeddings", None)
        span = n if side == "source" else need
        if limit is not None and span > limit:
            raise DocumentTooLongError(
                f"the evaluated span ({span} tokens) exceeds the {side}'s {limit} positions: "
                "lower --prefix-tokens (or --greedy-tokens)"
            )


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values))


def _given(values: Sequence[float | None]) -> list[float]:
    """The values of a metric every window has (the first window having it, all do: same row, same run)."""
    return [v for v in values if v is not None]


def _method_results(per_window: Sequence[_Window], greedy_tokens: int) -> list[MethodResult]:
    """Every row averaged over the windows; a metric no window has (no greedy run, no planned cost) is None."""
    results = []
    for name in per_window[0].rows:
        rows = [pw.rows[name] for pw in per_window]
        greedy = [r["greedy"] for r in rows if r["greedy"] is not None]
        nll = [r["nll_delta"] for r in rows if r["nll_delta"] == r["nll_delta"]]
        results.append(MethodResult(
            method=name, kl=_mean([r["kl"] for r in rows]), top1=_mean([r["top1"] for r in rows]),
            top5=_mean([r["top5"] for r in rows]), nll_delta=_mean(nll) if nll else None,
            map_seconds=_mean([r["map_seconds"] for r in rows]),
            prefill_seconds=_mean([r["prefill_seconds"] for r in rows]),
            greedy_agreement=_mean(greedy) if greedy else None, greedy_tokens=greedy_tokens,
            cost_fraction=_mean(_given([r["cost"] for r in rows])) if rows[0].get("cost") is not None else None,
            token_share=_mean(_given([r["tokens"] for r in rows])) if rows[0].get("tokens") is not None else None,
            measured_cost=_mean([r["measured"] for r in rows]) if rows[0].get("measured") is not None else None,
            repair=rows[0].get("repair"),
        ))
    return results


def _layer_curve(per_window: Sequence[Sequence[tuple[float, float]]]) -> list[LayerCurvePoint]:
    """One (kl, top1) curve per window, averaged layer by layer."""
    return [LayerCurvePoint(layer=i, kl=_mean([curve[i][0] for curve in per_window]),
                            top1=_mean([curve[i][1] for curve in per_window]))
            for i in range(len(per_window[0]))]


def _pass_cost_summary(costs: PassCosts, n: int) -> dict[str, object]:
    return {
        "per_pass": costs.per_pass, "per_token": costs.per_token, "per_key": costs.per_key,
        "per_past_key": costs.per_past_key, "per_past": costs.per_past, "per_copied": costs.per_copied,
        "fit_error": costs.fit_error, "key": costs.key, "measured_on": costs.measured_on,
        "predicted_prefill_seconds": costs.prefill_seconds(n)}


@dataclass
class _Window:
    """Raw results of one evaluation window."""

    rows: dict[str, _Row]
    single: list[tuple[float, float]]
    accum: list[tuple[float, float]]
    ref_seconds: float
    src_seconds: float


@dataclass(frozen=True)
class _EvalContext:
    """What every window of one evaluation runs: the models, the rows and their maps, the effective spans."""

    source: PreTrainedModel
    target: PreTrainedModel
    mapping: Mapping
    maps: dict[str, LinearKVMap]
    """The map of every pure-map row: the baselines this pair allows and the mapping's own."""
    order: Sequence[str]
    """The pure-map rows, in the report's order."""
    tail_rows: Sequence[str]
    """Methods scored with their tail recomputed (none without a tail)."""
    n: int
    """Prefix tokens."""
    m: int
    """Suffix tokens."""
    tail: int
    """Tail tokens the tail rows recompute."""
    sinks: int
    """Exact leading positions of the served cache (0: no sink row, and the pure map is served)."""
    greedy_tokens: int
    layer_curves: bool
    repairs: Sequence[RepairPolicy]
    costs: PassCosts | None
    """The target's timed pass costs pricing the plans (None: multiply-adds)."""
    timing_repeats: int

    @property
    def own(self) -> str:
        """The mapping's own method."""
        return self.mapping.manifest.method.name


def _evaluate_window(ctx: _EvalContext, ids: torch.Tensor) -> _Window:
    """Every row of one window (``ids``: ``[1, n + m + 1]`` tokens, the last one only a label)."""
    from mappings.cache_io import build_cache

    run = _WindowRun.start(ctx, ids)
    rows = {"reprefill": run.score(build_cache(run.true_layers, run.cfg), 0.0, run.ref_seconds, 1.0)}
    rows.update(run.map_rows())
    if ctx.sinks and run.served is not None:
        rows.update(run.sink_row())
    for name in ctx.tail_rows:
        rows.update(run.tail_row(name))
    if ctx.repairs and run.served is not None:
        rows.update(run.repair_rows())
    single: list[tuple[float, float]] = []
    accum: list[tuple[float, float]] = []
    if ctx.layer_curves and run.served is not None:
        single, accum = run.layer_curves()
    return _Window(rows, single, accum, run.ref_seconds, run.src_seconds)


@dataclass
class _WindowRun:
    """One window: the target's own prefill of the prefix (the truth every row is scored against), the
    source's prefill that the maps convert, and the served cache (the own map, sinks exact) that the tail,
    repair and layer-curve rows start from, as a FamilyCache's paths do."""

    ctx: _EvalContext
    prefix: torch.Tensor
    suffix: torch.Tensor
    labels: torch.Tensor
    true_layers: KVLayers
    true_logits: torch.Tensor
    true_greedy: list[int]
    ref_seconds: float
    src_layers: KVLayers
    src_hidden: dict[int, torch.Tensor] | None
    src_seconds: float
    served: KVLayers | None = None
    own_map_s: float = 0.0
    sink_s: float = 0.0
    exact: int = 0  # the served cache's exact leading positions (the sinks)

    @classmethod
    def start(cls, ctx: _EvalContext, ids: torch.Tensor) -> _WindowRun:
        import torch

        from mappings.cache_io import build_cache, cache_layers, forward_with_cache, model_device, sync_device

        source, target, n, m = ctx.source, ctx.target, ctx.n, ctx.m
        need_hidden = any(r.budget and (r.layer_share or r.blocks) for r in ctx.repairs)
        prefix, suffix = ids[:, :n], ids[:, n : n + m]
        labels = torch.full((1, m), -100, dtype=torch.long)
        nxt = ids[0, n + 1 : n + m + 1]
        labels[0, : nxt.numel()] = nxt
        dev, cfg = model_device(target), target.config

        # The reference is a prefill as the cache would do it: no logits beyond the last position (all of them
        # would add the LM head for every token, which no repair pays, and flatter the measured costs).
        ref_seconds = math.inf
        for _ in range(ctx.timing_repeats):  # the fastest run: a repair's timing below is the fastest of as many
            t0 = time.perf_counter()
            _, true_cache, _ = forward_with_cache(target, prefix, None, logits_to_keep=1)
            sync_device(dev)
            ref_seconds = min(ref_seconds, time.perf_counter() - t0)
        true_layers = list(cache_layers(true_cache))
        true_logits, after, _ = forward_with_cache(target, suffix, build_cache(true_layers, cfg))
        true_logits = true_logits.float()
        true_greedy = _greedy(target, after, true_logits, ctx.greedy_tokens) if ctx.greedy_tokens else []

        t0 = time.perf_counter()
        _, src_cache, src_out = forward_with_cache(source, prefix, None, output_hidden_states=need_hidden)
        src_seconds = time.perf_counter() - t0
        src_hidden = dict(enumerate(src_out.hidden_states[:-1])) if need_hidden else None
        return cls(ctx, prefix, suffix, labels, true_layers, true_logits, true_greedy, ref_seconds,
                   list(cache_layers(src_cache)), src_hidden, src_seconds)

    @property
    def target(self) -> PreTrainedModel:
        return self.ctx.target

    @property
    def n(self) -> int:
        return int(self.prefix.shape[1])

    @property
    def cfg(self) -> PretrainedConfig:
        return self.target.config

    @property
    def dev(self) -> torch.device:
        from mappings.cache_io import model_device

        return model_device(self.target)

    @property
    def dt(self) -> torch.dtype:
        from mappings.cache_io import model_dtype

        return model_dtype(self.target)

    def planned_share(self, tokens: Sequence[int]) -> float | None:
        from mappings.repair import compute_share

        costs = self.ctx.costs
        return costs.share(self.n, tokens) if costs is not None else compute_share(self.cfg, self.n, tokens)

    def score(self, cache: Cache, map_s: float, prefill_s: float, cost: float | None = None,
              repair: dict[str, object] | None = None, measured: float | None = None,
              tokens: float | None = None) -> _Row:
        """One row: the target continued on ``cache`` over the suffix, against its own prefill."""
        from mappings.cache_io import forward_with_cache
        from mappings.metrics import next_token_agreement

        logits, after_m, _ = forward_with_cache(self.target, self.suffix, cache)
        agree = next_token_agreement(self.true_logits, logits.float(), self.labels.to(logits.device))
        steps = self.ctx.greedy_tokens
        greedy = _greedy(self.target, after_m, logits, steps) if steps else None
        return {"kl": agree["kl"], "top1": agree["top1"], "top5": agree["top5"], "nll_delta": agree["nll_delta"],
                "map_seconds": map_s, "prefill_seconds": prefill_s, "cost": cost, "repair": repair,
                "tokens": tokens if tokens is not None else cost,
                "measured": measured if measured is not None else prefill_s / self.ref_seconds,
                "greedy": _first_divergence(self.true_greedy, greedy) if greedy is not None else None}

    def map_rows(self) -> dict[str, _Row]:
        """A pure map per method, timed; the own method's map becomes the served cache."""
        from mappings.cache_io import build_cache, sync_device

        rows = {}
        dev, dt, own = self.dev, self.dt, self.ctx.own
        for name in self.ctx.order:
            t0 = time.perf_counter()
            mapped = self.ctx.maps[name].apply(self.src_layers, device=dev, dtype=dt)
            cache = build_cache(mapped, self.cfg)
            sync_device(dev)
            map_s = time.perf_counter() - t0
            if name == own:
                self.served, self.own_map_s = mapped, map_s
            rows[name] = self.score(cache, map_s, 0.0, 0.0)
        return rows

    def sink_row(self) -> dict[str, _Row]:
        """What a FamilyCache serves: the map with its first `sinks` positions the target's own (a `sinks`-token
        forward); it replaces the pure map as the served cache."""
        from mappings.apply import exact_prefix
        from mappings.cache_io import build_cache, cache_layers, sync_device

        assert self.served is not None
        cache = build_cache([(a.clone(), b.clone()) for a, b in self.served], self.cfg)
        t0 = time.perf_counter()
        k = exact_prefix(self.target, cache, self.prefix, self.ctx.sinks)
        sync_device(self.dev)
        self.sink_s = time.perf_counter() - t0
        self.served, self.exact = list(cache_layers(cache)), k
        n, planned = self.n, self.planned_share(range(k))
        return {f"{self.ctx.own}+sinks{k}": self.score(cache, self.own_map_s, self.sink_s,
                                              k / n if planned is None else planned, tokens=k / n)}

    def tail_row(self, name: str) -> dict[str, _Row]:
        """The map of all but the last ``tail`` positions (the own one: the served cache), the tail recomputed."""
        from mappings.cache_io import build_cache, forward_with_cache, slice_layers, sync_device

        n, dev, tail, kv_map = self.n, self.dev, self.ctx.tail, self.ctx.maps[name]
        if name == self.ctx.own and self.served is not None:
            map_s, base, exact = self.own_map_s, slice_layers(self.served, 0, n - tail), min(self.exact, n - tail)
        else:
            t0 = time.perf_counter()
            base = kv_map.apply(slice_layers(self.src_layers, 0, n - tail), device=dev, dtype=self.dt)
            sync_device(dev)
            map_s, exact = time.perf_counter() - t0, 0
        t0 = time.perf_counter()
        _, cache, _ = forward_with_cache(self.target, self.prefix[:, n - tail :], build_cache(base, self.cfg),
                                         logits_to_keep=1)
        sync_device(dev)
        tail_s = time.perf_counter() - t0 + (self.sink_s if exact else 0.0)
        spent = [*range(exact), *range(n - tail, n)]
        planned = self.planned_share(spent)
        return {f"{name}+tail{tail}": self.score(cache, map_s, tail_s, len(spent) / n if planned is None else planned,
                                                 tokens=len(spent) / n)}

    def repair_rows(self) -> dict[str, _Row]:
        from mappings.cache_io import build_cache
        from mappings.repair import layer_scores, repair_cache

        assert self.served is not None
        mapping, own = self.ctx.mapping, self.ctx.own
        scores = layer_scores(mapping.manifest)
        residual = mapping.residual
        rows = {}
        for policy in self.ctx.repairs:
            # Every row repairs the same served map of the window (repair never modifies its input), so the map and
            # its sink pass are paid once; each row's cost counts the sink pass and its repair (the plan never
            # recomputes the exact sinks again).
            res, repair_s, target_s = None, math.inf, math.inf
            for _ in range(self.ctx.timing_repeats):  # deterministic: every run gives the same cache, the fastest is kept
                t0 = time.perf_counter()
                run = repair_cache(self.target, self.served, self.prefix, policy, layer_scores=scores,
                                   residual=residual, source_hidden=self.src_hidden, source=self.ctx.source,
                                   source_layers=self.src_layers, costs=self.ctx.costs, exact=self.exact)
                repair_s = min(repair_s, time.perf_counter() - t0 + self.sink_s)
                if run.target_seconds < target_s:
                    res, target_s = run, run.target_seconds
            assert res is not None
            rows[f"{own}+{policy.label}"] = self.score(
                build_cache(res.layers, self.cfg), self.own_map_s, repair_s, res.plan.cost, res.summary(),
                measured=(target_s + self.sink_s) / self.ref_seconds, tokens=res.plan.token_share)
        return rows

    def layer_curves(self) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """(kl, top1) with one layer served and the rest true, and with layers 0..i served."""
        from mappings.cache_io import build_cache, forward_with_cache
        from mappings.metrics import next_token_agreement

        assert self.served is not None
        true, served = self.true_layers, self.served
        single: list[tuple[float, float]] = []
        accum: list[tuple[float, float]] = []
        for i in range(len(true)):
            for mixed, out in (([*true[:i], served[i], *true[i + 1 :]], single),
                               ([*served[: i + 1], *true[i + 1 :]], accum)):
                logits, _, _ = forward_with_cache(self.target, self.suffix, build_cache(mixed, self.cfg))
                a = next_token_agreement(self.true_logits, logits.float())
                out.append((a["kl"], a["top1"]))
        return single, accum


def plot_layer_curves(report: EvaluationReport, path: str | Path) -> Path:
    """PNG of single-layer-replacement KL and the error-accumulation curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = [p.layer for p in report.single_layer]
    axes[0].bar(xs, [p.kl for p in report.single_layer], color="tab:blue")
    axes[0].set_title("single-layer replacement (one layer mapped)")
    axes[0].set_xlabel("target layer")
    axes[0].set_ylabel("mean KL vs re-prefill (nats)")
    axes[1].plot([p.layer for p in report.accumulation], [p.kl for p in report.accumulation], marker="o")
    axes[1].set_title("error accumulation (layers 0..k mapped)")
    axes[1].set_xlabel("k")
    axes[1].set_ylabel("mean KL vs re-prefill (nats)")
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"{report.mapping_method}: {report.document.get('name')}, {report.windows} x (prefix "
                 f"{report.prefix_tokens} + suffix {report.suffix_tokens})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(report: EvaluationReport, json_path: str | Path, *, plots: bool = True) -> EvaluationReport:
    """Write the report as JSON (and the layer-curve PNG next to it); returns the report with plot paths."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    if plots and report.single_layer:
        png = plot_layer_curves(report, json_path.with_name(json_path.stem + "_layers.png"))
        report = report.model_copy(update={"plots": [str(png)]})
    from mappings.atomic import write_atomic

    write_atomic(json_path, report.model_dump_json(indent=2) + "\n")  # a temporary sibling, then a rename
    return report
