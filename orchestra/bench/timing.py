"""Cost: the target's own prefill vs mapping the source's cache into it, side by side, per length.

For each pair and length, every repetition times (in alternating order, so neither side always
runs on a warmer cache) the target's prefill of the document prefix and the mapping of the
source's prefilled cache into a target cache (``map_cache``: map + build the cache the target
decodes from), plus the whole product path: a FamilyCache holding the source's cache asked for the
target's (lookup, map, tail recompute, entry bookkeeping; gates open). The ratio is taken per
repetition and the median reported; growth with length is the log-log slope over lengths.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from orchestra.bench._context import BenchFamily, Pair

if TYPE_CHECKING:
    import torch

    from mappings.store import Mapping

__all__ = ["TimingConfig", "TimingRow", "Growth", "TimingSection", "run_timing", "loglog_slope"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TimingConfig(_Model):
    pairs: list[Pair]
    lengths: list[int]
    repeats: int = Field(3, ge=1, description="side-by-side repetitions per pair and length (median reported)")
    tail_tokens: int = Field(32, ge=0, description="tokens the scheduler recomputes on the target after mapping")


class TimingRow(_Model):
    pair: str
    length: int
    repeats: int
    wrapped: bool = Field(description="the held-out document was shorter, so it was repeated to this length")
    target_prefill_s: list[float] = Field(description="each repetition's target prefill seconds")
    map_s: list[float] = Field(description="each repetition's map + inject seconds")
    map_tail_s: list[float] = Field(description="seconds of the FamilyCache mapped lease: lookup, map, tail recompute")
    source_prefill_s: list[float] = Field(description="the source prefill the map starts from (paid once per document)")
    target_prefill_median_s: float
    map_median_s: float
    map_tail_median_s: float
    source_prefill_median_s: float
    speedup: float = Field(description="median over repetitions of target prefill / map")
    speedup_with_tail: float = Field(description="median over repetitions of target prefill / (map + tail recompute)")


class Growth(_Model):
    """How a cost grows with document length: seconds ∝ length^exponent (log-log least squares)."""

    pair: str
    quantity: str
    exponent: float | None
    per_doubling: float | None = Field(description="factor per doubling of the length, 2**exponent")
    lengths: list[int]


class TimingSection(_Model):
    config: TimingConfig
    rows: list[TimingRow] = Field(default_factory=list)
    growth: list[Growth] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)

    def row(self, pair: str, length: int) -> TimingRow:
        return next(r for r in self.rows if (r.pair, r.length) == (pair, length))


def loglog_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y on log x (None with fewer than two usable points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _measure(fam: BenchFamily, pair: Pair, mapping: Mapping, ids: torch.Tensor, tail: int,
             repeats: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per repetition: target prefill, map + inject, the FamilyCache's mapped lease (map + tail), source prefill.

    The third is the product's own path: a fresh FamilyCache holding the source's cache is asked for the
    target's, and maps it (gates open: they are measured elsewhere).
    """
    import torch

    from mappings.apply import map_cache
    from mappings.cache_io import forward_with_cache

    source, target = fam.loaded(pair.source), fam.loaded(pair.target)

    tp: list[float] = []
    mp: list[float] = []
    mt: list[float] = []
    sp: list[float] = []

    def target_prefill() -> None:
        t0 = time.perf_counter()
        forward_with_cache(target.model, ids, None, logits_to_keep=1)
        _sync(target.device)
        tp.append(time.perf_counter() - t0)

    def mapped() -> None:
        t0 = time.perf_counter()
        _, src_cache, _ = forward_with_cache(source.model, ids.to(source.device), None, logits_to_keep=1)
        _sync(source.device)
        sp.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        map_cache(mapping.kv_map, src_cache, target.model)
        _sync(target.device)
        mp.append(time.perf_counter() - t0)
        cache = fam.family_cache(pair.source, tail_tokens=max(2, tail))
        ids_list = ids[0].tolist()
        cache.acquire_sync(pair.source, ids_list).release()
        t0 = time.perf_counter()
        with cache.acquire_sync(pair.target, ids_list) as lease:
            assert lease.path == "mapped", lease.fallback_reason
        _sync(target.device)
        mt.append(time.perf_counter() - t0)

    with torch.no_grad():
        for rep in range(repeats):
            for step in ((target_prefill, mapped) if rep % 2 == 0 else (mapped, target_prefill)):
                step()
    return tp, mp, mt, sp


def run_timing(config: TimingConfig, fam: BenchFamily, *, progress: bool = True) -> TimingSection:
    import torch
    from tqdm.auto import tqdm

    from mappings.apply import map_cache
    from mappings.cache_io import forward_with_cache

    section = TimingSection(config=config)
    jobs = [(p, n) for p in config.pairs for n in config.lengths]
    bar = tqdm(jobs, desc="timing", disable=not progress)
    warm: set[str] = set()
    for pair, n in bar:
        bar.set_postfix_str(f"{pair.label} @ {n}")
        limits = [x for x in (fam.max_positions(pair.source), fam.max_positions(pair.target)) if x]
        if limits and n > min(limits):
            section.skipped.append(f"{pair.label} @ {n}: longer than the models' {min(limits)} positions")
            continue
        mapping = fam.mapping(pair)
        source, target = fam.loaded(pair.source), fam.loaded(pair.target)
        ids_list, wrapped = fam.tokens(n)
        ids = torch.tensor([ids_list], device=target.device)
        tail = min(config.tail_tokens, n - 1)
        if pair.label not in warm:  # first-call costs (allocator, kernels) are not the steady state
            with torch.no_grad():
                _, c, _ = forward_with_cache(source.model, ids[:, :64], None, logits_to_keep=1)
                forward_with_cache(target.model, ids[:, :64], None, logits_to_keep=1)
                map_cache(mapping.kv_map, c, target.model)
            warm.add(pair.label)
        tp, mp, mt, sp = _measure(fam, pair, mapping, ids, tail, config.repeats)
        section.rows.append(TimingRow(
            pair=pair.label, length=n, repeats=config.repeats, wrapped=wrapped, target_prefill_s=tp, map_s=mp,
            map_tail_s=mt, source_prefill_s=sp, target_prefill_median_s=statistics.median(tp),
            map_median_s=statistics.median(mp), map_tail_median_s=statistics.median(mt),
            source_prefill_median_s=statistics.median(sp),
            speedup=statistics.median(a / b for a, b in zip(tp, mp, strict=True)),
            speedup_with_tail=statistics.median(a / b for a, b in zip(tp, mt, strict=True)),
        ))
    for pair in config.pairs:
        rows = sorted((r for r in section.rows if r.pair == pair.label), key=lambda r: r.length)
        for quantity, attr in (("target prefill", "target_prefill_median_s"), ("map", "map_median_s"),
                               ("map + tail", "map_tail_median_s")):
            slope = loglog_slope([r.length for r in rows], [getattr(r, attr) for r in rows])
            section.growth.append(Growth(pair=pair.label, quantity=quantity, exponent=slope,
                                         per_doubling=2**slope if slope is not None else None,
                                         lengths=[r.length for r in rows]))
    return section
