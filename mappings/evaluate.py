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
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from mappings.errors import DocumentTooLongError, DocumentTooShortError

if TYPE_CHECKING:
    import torch

    from mappings.apply import LinearKVMap
    from mappings.repair import RepairPolicy
    from mappings.store import Mapping

__all__ = ["MethodResult", "LayerCurvePoint", "EvaluationReport", "evaluate", "write_report", "plot_layer_curves",
           "BASELINES"]

BASELINES = ("identity", "ridge", "anchored", "perhead_rope")


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
    source: dict[str, Any] = Field(description="path and fingerprint of the source")
    target: dict[str, Any] = Field(description="path and fingerprint of the target")
    document: dict[str, Any] = Field(description="name, sha256 and token counts of the document")
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
    pass_costs: dict[str, Any] | None = Field(
        default=None, description="the target's measured pass costs that priced the plans (None: multiply-adds)")

    def row(self, method: str) -> MethodResult:
        for r in self.methods:
            if r.method == method:
                return r
        raise KeyError(method)


def _greedy(model: Any, cache: Any, first_logits: torch.Tensor, steps: int) -> list[int]:
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


def _baseline_maps(mapping: Mapping, names: Sequence[str], identical_layout: bool, source_config: Any,
                   target_config: Any) -> tuple[dict[str, LinearKVMap], dict[str, str]]:
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
    *,
    source: Any = None,
    target: Any = None,
    prefix_tokens: int = 1024,
    suffix_tokens: int = 32,
    windows: int = 1,
    tail_tokens: int = 64,
    sink_tokens: int = 4,
    greedy_tokens: int = 64,
    baselines: Sequence[str] = BASELINES,
    layer_curves: bool = True,
    document_name: str = "document",
    device: str = "cpu",
    progress: bool = False,
    repairs: Sequence[RepairPolicy] = (),
    repair_costs: str = "measured",
    timing_repeats: int = 2,
) -> EvaluationReport:
    """Evaluate a mapping (directory or loaded) on one document; see the module docstring.

    ``windows`` consecutive spans of ``prefix_tokens + suffix_tokens`` from the start of the
    document are scored and averaged. ``source``/``target`` default to the model folders recorded
    in the manifest; their fingerprints are checked against the mapping (:class:`StaleMappingError`).
    ``repairs``: map-then-repair policies scored as extra rows ``<method>+repair@<budget>``.
    ``sink_tokens``: a row ``<method>+sinks<k>``, the map with its first ``k`` positions the target's own
    (what a FamilyCache serves by default; 0: no such row), at least the mapping method's ``exact_sinks`` (a
    map fitted without its sinks is only served with them). The tail, repair and layer-curve rows start
    from that served cache, as a FamilyCache's paths do. ``repair_costs``: how the repair rows' budgets
    and every row's planned ``cost`` are priced: ``measured`` (the target's timed passes on this machine,
    :func:`mappings.passcost.load_or_measure`, kept in ``pass-costs/`` beside the mapping, as a FamilyCache
    prices them) or ``compute`` (multiply-adds from the target's config). Timings are only taken when there
    are repair rows; without them every planned cost is in compute (the report's ``pass_costs`` is None).
    ``timing_repeats``: the reference prefill and every repair are timed as the fastest of this many runs
    (their results are identical), as the pass costs that plan them are: on a shared machine one run can
    take twice as long as the next, and a measured cost is a ratio of two such timings.
    """
    import torch
    from tqdm.auto import tqdm

    from mappings.capture import kv_shape
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

    # ---- the document
    if isinstance(document, str):
        doc_sha = hashlib.sha256(document.encode("utf-8")).hexdigest()
        ids_all = tgt.tokenizer(document, add_special_tokens=False)["input_ids"]
    else:
        ids_all = list(document)
        doc_sha = hashlib.sha256(",".join(map(str, ids_all)).encode()).hexdigest()
    n, m, windows = int(prefix_tokens), int(suffix_tokens), int(windows)
    if n < 1 or m < 1 or windows < 1:
        raise ValueError("prefix, suffix and windows need to be at least 1")
    if len(ids_all) < windows * (n + m):
        raise DocumentTooShortError(
            f"{document_name} has {len(ids_all)} tokens, the evaluation needs {windows} window(s) of prefix {n} + "
            f"suffix {m}: pass a longer document or lower --prefix-tokens / --suffix-tokens / --windows"
        )
    need = n + m + greedy_tokens
    for side, model in (("source", src.model), ("target", tgt.model)):
        limit = getattr(model.config, "max_position_embeddings", None)
        span = n if side == "source" else need
        if limit is not None and span > limit:
            raise DocumentTooLongError(
                f"the evaluated span ({span} tokens) exceeds the {side}'s {limit} positions: "
                "lower --prefix-tokens (or --greedy-tokens)"
            )
    tail = max(0, min(int(tail_tokens), n - 1))
    if int(timing_repeats) < 1:
        raise ValueError(f"timing_repeats is at least 1, not {timing_repeats}")
    if repair_costs not in ("measured", "compute"):
        raise ValueError(f"repair_costs is 'measured' or 'compute', not {repair_costs!r}")
    costs = None
    if repair_costs == "measured" and repairs:  # timing a target (a minute on CPU) pays only where budgets need it
        from mappings.passcost import load_or_measure

        where = Path(mapping_dir).parent / "pass-costs" if mapping_dir is not None else None
        costs = load_or_measure(tgt.model, tgt.fingerprint.combined, where)

    identical = kv_shape(src.model.config) == kv_shape(tgt.model.config)
    maps, skipped = _baseline_maps(mapping, [b for b in baselines if b != "reprefill"], identical,
                                   src.model.config, tgt.model.config)
    own = mapping.manifest.method.name
    maps[own] = mapping.kv_map
    order = [b for b in baselines if b in maps] + ([own] if own not in baselines else [])
    tail_rows = ([own] + (["identity"] if "identity" in maps else [])) if tail else []

    # A mapping fitted with exact sinks is only ever served with them (FamilyCache makes at least that many exact)
    sink_tokens = max(int(sink_tokens), mapping.manifest.method.exact_sinks)
    per_window: list[_Window] = []
    bar = tqdm(total=windows, desc="evaluating windows", disable=not progress)
    for w in range(windows):
        span = torch.tensor(ids_all[w * (n + m) : w * (n + m) + n + m + 1])[None]
        per_window.append(_evaluate_window(src.model, tgt.model, maps, order, tail_rows, own, span, n, m, tail,
                                           greedy_tokens, layer_curves, mapping, repairs, sink_tokens, costs,
                                           timing_repeats=int(timing_repeats) if repairs else 1))
        bar.update(1)
    bar.close()

    def mean(values: Sequence[float]) -> float:
        return float(sum(values) / len(values))

    results = []
    for name in per_window[0].rows:
        rows = [pw.rows[name] for pw in per_window]
        greedy = [r["greedy"] for r in rows if r["greedy"] is not None]
        nll = [r["nll_delta"] for r in rows if r["nll_delta"] == r["nll_delta"]]
        results.append(MethodResult(
            method=name, kl=mean([r["kl"] for r in rows]), top1=mean([r["top1"] for r in rows]),
            top5=mean([r["top5"] for r in rows]), nll_delta=mean(nll) if nll else None,
            map_seconds=mean([r["map_seconds"] for r in rows]), prefill_seconds=mean([r["prefill_seconds"] for r in rows]),
            greedy_agreement=mean(greedy) if greedy else None, greedy_tokens=greedy_tokens,
            cost_fraction=mean([r["cost"] for r in rows]) if rows[0].get("cost") is not None else None,
            token_share=mean([r["tokens"] for r in rows]) if rows[0].get("tokens") is not None else None,
            measured_cost=mean([r["measured"] for r in rows]) if rows[0].get("measured") is not None else None,
            repair=rows[0].get("repair"),
        ))
    single = [LayerCurvePoint(layer=i, kl=mean([pw.single[i][0] for pw in per_window]),
                              top1=mean([pw.single[i][1] for pw in per_window]))
              for i in range(len(per_window[0].single))]
    accum = [LayerCurvePoint(layer=i, kl=mean([pw.accum[i][0] for pw in per_window]),
                             top1=mean([pw.accum[i][1] for pw in per_window]))
             for i in range(len(per_window[0].accum))]
    return EvaluationReport(
        mapping=str(mapping_dir) if mapping_dir is not None else None,
        mapping_method=own,
        source={"path": str(src.path) if src.path else None, "fingerprint": src.fingerprint.as_dict()},
        target={"path": str(tgt.path) if tgt.path else None, "fingerprint": tgt.fingerprint.as_dict()},
        document={"name": document_name, "sha256": doc_sha, "tokens": len(ids_all)},
        prefix_tokens=n, suffix_tokens=m, windows=windows, tail_tokens=tail,
        reference_prefill_seconds=mean([pw.ref_seconds for pw in per_window]),
        source_prefill_seconds=mean([pw.src_seconds for pw in per_window]),
        methods=results, skipped=skipped, single_layer=single, accumulation=accum,
        pass_costs=None if costs is None else {
            "per_pass": costs.per_pass, "per_token": costs.per_token, "per_key": costs.per_key,
            "per_past_key": costs.per_past_key, "per_past": costs.per_past, "per_copied": costs.per_copied,
            "fit_error": costs.fit_error, "key": costs.key, "measured_on": costs.measured_on,
            "predicted_prefill_seconds": costs.prefill_seconds(n)},
    )


@dataclass
class _Window:
    """Raw results of one evaluation window."""

    rows: dict[str, dict[str, Any]]
    single: list[tuple[float, float]]
    accum: list[tuple[float, float]]
    ref_seconds: float
    src_seconds: float


def _evaluate_window(
    source: Any, target: Any, maps: dict[str, LinearKVMap], order: Sequence[str], tail_rows: Sequence[str],
    own: str, ids: torch.Tensor, n: int, m: int, tail: int, greedy_tokens: int, layer_curves: bool,
    mapping: Mapping | None = None, repairs: Sequence[RepairPolicy] = (), sinks: int = 0, costs: Any = None,
    timing_repeats: int = 1,
) -> _Window:
    import torch

    from mappings.cache_io import (
        build_cache,
        cache_layers,
        forward_with_cache,
        model_device,
        model_dtype,
        slice_layers,
        sync_device,
    )
    from mappings.metrics import next_token_agreement
    from mappings.repair import compute_share

    def planned_share(tokens: Sequence[int]) -> float | None:
        return costs.share(n, tokens) if costs is not None else compute_share(cfg, n, tokens)

    prefix, suffix = ids[:, :n], ids[:, n : n + m]
    labels = torch.full((1, m), -100, dtype=torch.long)
    nxt = ids[0, n + 1 : n + m + 1]
    labels[0, : nxt.numel()] = nxt
    dev, dt, cfg = model_device(target), model_dtype(target), target.config

    # The reference is a prefill as the cache would do it: no logits beyond the last position (all of them
    # would add the LM head for every token, which no repair pays, and flatter the measured costs).
    ref_seconds = math.inf
    for _ in range(timing_repeats):  # the fastest run: a repair's timing below is the fastest of as many
        t0 = time.perf_counter()
        _, true_cache, _ = forward_with_cache(target, prefix, None, logits_to_keep=1)
        sync_device(dev)
        ref_seconds = min(ref_seconds, time.perf_counter() - t0)
    true_layers = list(cache_layers(true_cache))
    true_logits, after, _ = forward_with_cache(target, suffix, build_cache(true_layers, cfg))
    true_logits = true_logits.float()
    true_greedy = _greedy(target, after, true_logits, greedy_tokens) if greedy_tokens else []

    need_hidden = any(r.budget and (r.layer_share or r.blocks) for r in repairs)
    t0 = time.perf_counter()
    _, src_cache, src_out = forward_with_cache(source, prefix, None, output_hidden_states=need_hidden)
    src_seconds = time.perf_counter() - t0
    src_layers = list(cache_layers(src_cache))
    src_hidden = dict(enumerate(src_out.hidden_states[:-1])) if need_hidden else None
    del src_out

    def score(cache: Any, map_s: float, prefill_s: float, cost: float | None = None,
              repair: dict[str, Any] | None = None, measured: float | None = None,
              tokens: float | None = None) -> dict[str, Any]:
        logits, after_m, _ = forward_with_cache(target, suffix, cache)
        agree = next_token_agreement(true_logits, logits.float(), labels.to(logits.device))
        greedy = _greedy(target, after_m, logits, greedy_tokens) if greedy_tokens else None
        return {**agree, "map_seconds": map_s, "prefill_seconds": prefill_s, "cost": cost, "repair": repair,
                "tokens": tokens if tokens is not None else cost,
                "measured": measured if measured is not None else prefill_s / ref_seconds,
                "greedy": _first_divergence(true_greedy, greedy) if greedy is not None else None}

    rows = {"reprefill": score(build_cache(true_layers, cfg), 0.0, ref_seconds, 1.0)}
    mapped_own, own_map_s = None, 0.0
    for name in order:
        t0 = time.perf_counter()
        mapped = maps[name].apply(src_layers, device=dev, dtype=dt)
        cache = build_cache(mapped, cfg)
        sync_device(dev)
        map_s = time.perf_counter() - t0
        if name == own:
            mapped_own, own_map_s = mapped, map_s
        rows[name] = score(cache, map_s, 0.0, 0.0)
    # What a FamilyCache serves: the map with its first `sinks` positions the target's own (a `sinks`-token
    # forward). The tail, repair and layer-curve rows all start from it, as the cache's own paths do.
    served, sink_s, k = mapped_own, 0.0, 0
    if sinks and mapped_own is not None:
        from mappings.apply import exact_prefix

        cache = build_cache([(a.clone(), b.clone()) for a, b in mapped_own], cfg)
        t0 = time.perf_counter()
        k = exact_prefix(target, cache, prefix, sinks)
        sync_device(dev)
        sink_s = time.perf_counter() - t0
        served = list(cache_layers(cache))
        planned = planned_share(range(k))
        rows[f"{own}+sinks{k}"] = score(cache, own_map_s, sink_s, k / n if planned is None else planned, tokens=k / n)
    for name in tail_rows:
        if name == own and served is not None:
            map_s, base, exact = own_map_s, slice_layers(served, 0, n - tail), min(k, n - tail)
        else:
            t0 = time.perf_counter()
            base = maps[name].apply(slice_layers(src_layers, 0, n - tail), device=dev, dtype=dt)
            sync_device(dev)
            map_s, exact = time.perf_counter() - t0, 0
        t0 = time.perf_counter()
        _, cache, _ = forward_with_cache(target, prefix[:, n - tail :], build_cache(base, cfg), logits_to_keep=1)
        sync_device(dev)
        tail_s = time.perf_counter() - t0 + (sink_s if exact else 0.0)
        spent = [*range(exact), *range(n - tail, n)]
        planned = planned_share(spent)
        rows[f"{name}+tail{tail}"] = score(cache, map_s, tail_s, len(spent) / n if planned is None else planned,
                                           tokens=len(spent) / n)
    if repairs and served is not None:
        from mappings.repair import layer_scores, repair_cache

        scores = layer_scores(mapping.manifest) if mapping is not None else None
        residual = mapping.residual if mapping is not None else None
        for policy in repairs:
            # Every row repairs the same served map of the window (repair never modifies its input), so the map and
            # its sink pass are paid once; each row's cost counts the sink pass and its repair (the plan never
            # recomputes the exact sinks again).
            res, repair_s, target_s = None, math.inf, math.inf
            for _ in range(timing_repeats):  # deterministic: every run gives the same cache, the fastest is kept
                t0 = time.perf_counter()
                run = repair_cache(target, served, prefix, policy, layer_scores=scores, residual=residual,
                                   source_hidden=src_hidden, source=source, source_layers=src_layers, costs=costs,
                                   exact=k)
                repair_s = min(repair_s, time.perf_counter() - t0 + sink_s)
                if run.target_seconds < target_s:
                    res, target_s = run, run.target_seconds
            assert res is not None
            rows[f"{own}+{policy.label}"] = score(build_cache(res.layers, cfg), own_map_s, repair_s, res.plan.cost,
                                                  res.summary(), measured=(target_s + sink_s) / ref_seconds,
                                                  tokens=res.plan.token_share)

    single: list[tuple[float, float]] = []
    accum: list[tuple[float, float]] = []
    if layer_curves and served is not None:
        for i in range(len(true_layers)):
            for mixed, out in (
                ([*true_layers[:i], served[i], *true_layers[i + 1 :]], single),
                ([*served[: i + 1], *true_layers[i + 1 :]], accum),
            ):
                logits, _, _ = forward_with_cache(target, suffix, build_cache(mixed, cfg))
                a = next_token_agreement(true_logits, logits.float())
                out.append((a["kl"], a["top1"]))
    return _Window(rows, single, accum, ref_seconds, src_seconds)


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
