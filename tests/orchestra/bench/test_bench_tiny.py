"""The bench sections on the tiny llama family: real measurements of tiny models, asserted for shape and sense."""

from __future__ import annotations

import json
import math

import pytest

from tests.orchestra.bench.conftest import TINY_LENGTHS, TINY_PAIRS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_json_validates_against_the_model(tiny_results):
    from orchestra.bench import BenchResults

    result, out = tiny_results
    loaded = BenchResults.model_validate_json((out / "bench.json").read_text())
    assert loaded == result
    assert loaded.command == "orchestra bench --quick (tiny test)"
    assert loaded.machine.cpu_count >= 1 and loaded.machine.torch and loaded.machine.transformers
    assert set(loaded.section_seconds) == {"crossfamily", "quality", "repair", "timing", "tasks", "pipeline",
                                           "calibration"}
    # the store had no mapping in either direction: the run calibrated both, where the scheduler looks
    assert {c["pair"] for c in loaded.calibrated} == set(TINY_PAIRS)
    assert all(json.loads((out / "bench.json").read_text())[k] is not None for k in ("quality", "timing", "tasks"))


def test_quality_rows_come_from_evaluate(tiny_results):
    from mappings.evaluate import BASELINES

    q = tiny_results[0].quality
    assert q is not None and q.document == "gpl-3.txt"
    methods = q.methods()
    assert methods[0] == "reprefill"
    # every baseline evaluate runs by default, the mapping's own method and tail variants
    for name in BASELINES:
        assert name in methods
    assert any("+tail" in m for m in methods)
    for pair in TINY_PAIRS:
        for n in TINY_LENGTHS:
            truth = q.row(pair, n, "reprefill")
            assert truth.kl == pytest.approx(0.0, abs=1e-5) and truth.top1 == 1.0
            assert truth.windows == 2
            assert q.row(pair, n, "identity").kl > 0  # parent and child differ
    # one accumulation curve per pair, over every target layer, at the same length
    assert {c.pair for c in q.curves} == set(TINY_PAIRS)
    assert {c.length for c in q.curves} == {TINY_LENGTHS[0]}
    assert all(len(c.kl) == 4 and len(c.single_layer_kl) == 4 for c in q.curves)


def test_timing_ratios_are_computed_from_the_measurements(tiny_results):
    import statistics

    t = tiny_results[0].timing
    assert t is not None and len(t.rows) == len(TINY_PAIRS) * len(TINY_LENGTHS)
    for r in t.rows:
        assert len(r.target_prefill_s) == len(r.map_s) == len(r.map_tail_s) == len(r.source_prefill_s) == 2
        assert all(x > 0 for x in r.target_prefill_s + r.map_s + r.map_tail_s)
        assert r.target_prefill_median_s == statistics.median(r.target_prefill_s)
        assert r.map_median_s == statistics.median(r.map_s)
        assert r.speedup == pytest.approx(statistics.median(a / b for a, b in zip(r.target_prefill_s, r.map_s, strict=True)))
        assert r.speedup_with_tail == pytest.approx(
            statistics.median(a / b for a, b in zip(r.target_prefill_s, r.map_tail_s, strict=True)))
        assert not r.wrapped
    growth = {(g.pair, g.quantity): g for g in t.growth}
    for pair in TINY_PAIRS:
        g = growth[(pair, "target prefill")]
        rows = sorted((r for r in t.rows if r.pair == pair), key=lambda r: r.length)
        expected = math.log(rows[1].target_prefill_median_s / rows[0].target_prefill_median_s) / math.log(2)
        assert g.exponent == pytest.approx(expected) and g.per_doubling == pytest.approx(2**expected)


def test_tasks_answer_questions_on_mapped_and_own_caches(tiny_results):
    k = tiny_results[0].tasks
    assert k is not None and k.config.source == "base" and k.config.members == ["child"]
    assert k.questions == 2 and not k.skipped
    assert {(s.member, s.condition) for s in k.scores} == {("child", "own"), ("child", "mapped"),
                                                           ("child", "mapped+repair"), ("base", "source"),
                                                           ("child", "plain"), ("base", "plain")}
    assert k.score("child", "mapped").paths == {"mapped": 2} and k.score("child", "own").paths == {"exact": 2}
    for s in k.scores:
        assert s.n == 2 and 0.0 <= s.accuracy <= 1.0


def test_pipeline_compares_shared_and_reprefill(tiny_results):
    p = tiny_results[0].pipeline
    assert p is not None and len(p.runs) == 1
    run = p.runs[0]
    assert run.agents_count == 2 and run.members == ["base", "child"]
    assert [a.model for a in run.agents] == ["base", "child"]
    assert run.agents[0].cache_path == "exact"
    assert run.agents[1].cache_path in {"mapped", "reprefilled"}
    assert run.fallbacks == sum(1 for a in run.agents if a.fallback_reason)
    assert run.total_prefill_s_shared > 0 and run.total_prefill_s_baseline > 0
    assert run.prefill_ratio_baseline_over_shared == pytest.approx(
        run.total_prefill_s_baseline / run.total_prefill_s_shared)


def test_calibration_rows(tiny_results):
    c = tiny_results[0].calibration
    assert c is not None
    origins = [(r.pair, r.origin) for r in c.rows]
    assert origins == [("base>child", "store"), ("child>base", "store"), ("base>child", "timed")]
    timed = c.rows[-1]
    assert timed.tokens == 256 and timed.seconds > 0 and timed.path is None
    for r in c.rows:
        assert r.map_bytes > 0 and r.model_bytes > 0
        assert r.map_fraction_of_model == pytest.approx(r.map_bytes / r.model_bytes)


def test_cross_family_pair_is_refused(tiny_results):
    x = tiny_results[0].crossfamily
    assert x is not None and x.all_refused
    assert [r.error_type for r in x.refusals] == ["TokenizerMismatchError", "CrossFamilyError"]


def test_markdown_has_the_rows_and_the_pngs_are_pngs(tiny_results):
    result, out = tiny_results
    md = (out / "bench.md").read_text()
    assert "Command: `orchestra bench --quick (tiny test)`" in md
    assert result.machine.cpu_model in md
    for pair in TINY_PAIRS:
        for n in TINY_LENGTHS:
            assert f"| {pair} | {n} | reprefill |" in md
            assert f"| {pair} | {n} | " in md
    assert "TokenizerMismatchError" in md and "CrossFamilyError" in md
    assert "## Pipeline" in md and "## Calibration cost" in md and "## Task level" in md
    assert sorted(result.plots) == ["bench_cost_vs_length.png", "bench_kl_by_method.png", "bench_quality_vs_layers.png",
                                    "bench_repair_curve.png"]
    assert "## Map, then repair" in md
    for name in result.plots:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
        assert f"]({name})" in md


def test_repair_curve_runs_from_the_map_to_reprefill(tiny_results):
    """Forward pair only; budgets 0 (map), 0.1, 0.5, the scattered variant at 0.15, and re-prefill at cost 1."""
    result, _ = tiny_results
    rp = result.repair
    assert rp is not None
    points = {p.label: p for p in rp.points}
    assert {p.pair for p in rp.points} == {"base>child"}
    assert set(points) == {"map", "repair@10%", "repair@50%", "repair@15%,S0.25", "reprefill"}
    assert points["reprefill"].kl == 0.0 and points["reprefill"].measured_cost == 1.0
    # the map spends no target compute: its seconds are reported beside the repair's, not in its measured cost
    assert points["map"].planned_cost == 0.0 and points["map"].measured_cost == 0.0 and points["map"].map_share > 0
    # planned in compute (attention counted) within the budget; the token share is what was recomputed
    p50 = points["repair@50%"]
    # the repair starts from the served map, whose 4 exact sinks it pays for but never recomputes
    assert 0.5 - 2 / 96 < p50.planned_cost <= 0.5 and p50.tokens + 4 < 48
    assert p50.token_share == pytest.approx((p50.tokens + 4) / 96)
    assert p50.measured_cost > 0 and p50.map_share == pytest.approx(points["map"].map_share)
    assert points["repair@50%"].kl < points["map"].kl
    assert any("no residual maps" in s for s in rp.skipped)
