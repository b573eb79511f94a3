"""benchmarks/length_growth.py: the growth exponent, the tables and the plot, on hand-made results."""

from __future__ import annotations

import math

import pytest

from tests.benchmarks.conftest import load_script


@pytest.fixture(scope="module")
def lg():
    return load_script("length_growth")


def _fixed(cuts, kls):
    ends = [4100, 5000]
    rows = {name: [{"cut": c, "kl": k * f, "top1": 0.95,
                    "per_end": [{"end": e, "kl": k * f * (1 + i / 10), "top1": 0.95} for i, e in enumerate(ends)]}
                   for c, k in zip(cuts, kls, strict=True)]
            for name, f in (("map", 1.0), ("true_first4", 0.8), ("identity", 2.0))}
    return {"member": "m", "role": "finetuned", "layout": "chat", "design": "fixed_suffix", "ends": ends,
            "method": "anchored_kl", "cuts": cuts, "suffix": 32, "sinks": 4, "template_tokens": 59, "rows": rows,
            "growth_exponents": {n: None for n in rows}}


def test_slope_is_the_log_log_growth_exponent(lg):
    xs = [512, 1024, 2048, 4096]
    assert lg._slope(xs, [0.01 * (x / 512) ** 0.5 for x in xs]) == pytest.approx(0.5)
    assert lg._slope(xs, [0.02] * 4) == pytest.approx(0.0, abs=1e-12)
    assert lg._slope([512], [0.01]) is None and lg._slope(xs, [0.0] * 4) is None


def test_fixed_design_table_reads_ratio_and_per_end_rows(lg):
    cuts = [512, 1024, 2048, 4096]
    res = _fixed(cuts, [0.03, 0.03, 0.0285, 0.027])
    res["growth_exponents"] = {n: lg._slope(cuts, [r["kl"] for r in rs]) for n, rs in res["rows"].items()}
    md = lg.markdown([res], "python benchmarks/length_growth.py --design fixed")
    assert "KL of the next 32 tokens" in md and "| KL@4096 / KL@1024 |" in md
    assert "| map | 0.0300 | 0.0300 | 0.0285 | 0.0270 | 0.950 | 0.90 |" in md
    assert "| true_first4 | 5000 | " in md  # one row per scored stretch of text
    assert math.isclose(res["growth_exponents"]["map"], lg._slope(cuts, [0.03, 0.03, 0.0285, 0.027]))


def test_plot_writes_a_png(lg, tmp_path):
    res = _fixed([512, 1024], [0.03, 0.02])
    path = lg.plot([res, res], tmp_path / "growth.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
