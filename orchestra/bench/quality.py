"""Quality: how close each method brings the target to its own prefill, per pair and document length.

Every row comes from :func:`mappings.evaluate.evaluate` (re-prefill truth, identity, ridge,
anchored, per-head RoPE, the mapping's own method, tail-recompute variants, and whatever else
``evaluate`` reports), so methods added there show up here without a change. The
error-accumulation curve (layers ``0..k`` mapped) is taken at one length per pair.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from orchestra.bench._context import BenchFamily, Pair

__all__ = ["QualityConfig", "QualityRow", "QualityCurve", "QualitySection", "run_quality"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QualityConfig(_Model):
    pairs: list[Pair]
    lengths: list[int] = Field(description="prefix (cached) tokens")
    suffix_tokens: int = Field(32, ge=1, description="real tokens after the prefix, scored against the truth")
    windows: int = Field(1, ge=1, description="consecutive document spans averaged (fewer where the document is short)")
    tail_tokens: int = Field(32, ge=0, description="tail-recompute variants recompute this many prefix tokens")
    greedy_tokens: int = Field(32, ge=0, description="greedy continuation compared after the suffix")
    curve_length: int | None = Field(None, description="length at which the layer curves are measured (None: the first run)")


class QualityRow(_Model):
    """One method on one pair at one length (a row of evaluate's table)."""

    pair: str
    length: int
    windows: int
    method: str
    kl: float
    top1: float
    top5: float
    nll_delta: float | None
    greedy_agreement: float | None
    greedy_tokens: int
    map_seconds: float
    prefill_seconds: float


class QualityCurve(_Model):
    """Error accumulation for one pair: KL when target layers 0..k come from the mapping's own method."""

    pair: str
    length: int
    method: str
    layers: list[int]
    kl: list[float]
    top1: list[float]
    single_layer_kl: list[float] = Field(default_factory=list, description="KL with only layer i mapped")


class QualitySection(_Model):
    config: QualityConfig
    document: str
    document_tokens: int
    rows: list[QualityRow] = Field(default_factory=list)
    curves: list[QualityCurve] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list, description="pair/length/method combinations not run, and why")

    def row(self, pair: str, length: int, method: str) -> QualityRow:
        for r in self.rows:
            if (r.pair, r.length, r.method) == (pair, length, method):
                return r
        raise KeyError((pair, length, method))

    def methods(self) -> list[str]:
        """Methods in first-seen order (re-prefill first, as evaluate orders them)."""
        return list(dict.fromkeys(r.method for r in self.rows))


def run_quality(config: QualityConfig, fam: BenchFamily, *, progress: bool = True) -> QualitySection:
    from tqdm.auto import tqdm

    from mappings.evaluate import EvaluationSettings, evaluate

    ids = fam.document_ids()
    section = QualitySection(config=config, document=fam.document_name, document_tokens=len(ids))
    curve_length = config.curve_length
    jobs = [(p, n) for p in config.pairs for n in config.lengths]
    bar = tqdm(jobs, desc="quality", disable=not progress)
    for pair, n in bar:
        bar.set_postfix_str(f"{pair.label} @ {n}")
        m = config.suffix_tokens
        limit = fam.max_positions(pair.target)
        if limit is not None and n + m + config.greedy_tokens > limit:
            section.skipped.append(
                f"{pair.label} @ {n}: prefix {n} + suffix {m} + greedy {config.greedy_tokens} tokens exceed the "
                f"target's {limit} positions (timing still covers this length)")
            continue
        windows = min(config.windows, (len(ids) - 1) // (n + m))
        if windows < 1:
            section.skipped.append(
                f"{pair.label} @ {n}: {fam.document_name} has {len(ids)} tokens, fewer than prefix {n} + suffix {m} "
                "(quality is only measured on unrepeated held-out text)")
            continue
        mapping = fam.mapping(pair)
        curves = curve_length is None or curve_length == n
        settings = EvaluationSettings(prefix_tokens=n, suffix_tokens=m, windows=windows,
                                      tail_tokens=config.tail_tokens, greedy_tokens=config.greedy_tokens,
                                      layer_curves=curves, device=fam.device)
        report = evaluate(mapping, ids, settings, source=fam.handle(pair.source), target=fam.handle(pair.target),
                          document_name=fam.document_name)
        for r in report.methods:
            section.rows.append(QualityRow(
                pair=pair.label, length=n, windows=windows, method=r.method, kl=r.kl, top1=r.top1, top5=r.top5,
                nll_delta=r.nll_delta, greedy_agreement=r.greedy_agreement, greedy_tokens=r.greedy_tokens,
                map_seconds=r.map_seconds, prefill_seconds=r.prefill_seconds,
            ))
        for name, why in report.skipped.items():
            section.skipped.append(f"{pair.label} @ {n}: {name}: {why}")
        if curves and report.accumulation:
            curve_length = n  # one curve per pair, at the same length for every pair
            section.curves.append(QualityCurve(
                pair=pair.label, length=n, method=report.mapping_method,
                layers=[p.layer for p in report.accumulation], kl=[p.kl for p in report.accumulation],
                top1=[p.top1 for p in report.accumulation], single_layer_kl=[p.kl for p in report.single_layer],
            ))
    return section
