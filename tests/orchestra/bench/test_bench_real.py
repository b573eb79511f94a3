"""`orchestra bench --quick` on the bundled SmolLM2 family, cut down to one pair and one length."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner


@pytest.mark.real_model
def test_quick_bench_on_the_real_family(real_family, tmp_path):
    from orchestra.bench import BenchResults
    from orchestra.cli import app

    out = tmp_path / "results"
    result = CliRunner().invoke(app, [
        "bench", "--quick", "--pairs", "root>finetuned", "--lengths", "512", "--sections",
        "crossfamily,quality,timing", "--repeats", "2", "--home", real_family.home, "--out", str(out), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    bench = BenchResults.model_validate_json((out / "bench.json").read_text())
    assert set(bench.section_seconds) == {"crossfamily", "quality", "timing"}
    assert bench.tasks is None and bench.pipeline is None and bench.calibration is None

    q = bench.quality
    assert q is not None and q.document == "gpl-3.txt"
    own = q.curves[0].method
    for method in ("reprefill", "identity", "ridge", "anchored", "perhead_rope", own, f"{own}+sinks4", f"{own}+tail32"):
        assert q.row("root>finetuned", 512, method) is not None
    # the map as served (its 4 sinks exact) beats reusing the root's KV unchanged on held-out text (held-out KL
    # 0.018 vs 0.085 in calibration)
    assert q.row("root>finetuned", 512, f"{own}+sinks4").kl < q.row("root>finetuned", 512, "identity").kl
    assert len(q.curves[0].kl) == 30

    row = bench.timing.row("root>finetuned", 512)
    ratios = [a / b for a, b in zip(row.target_prefill_s, row.map_s, strict=True)]
    assert row.repeats == 2 and row.speedup == pytest.approx(sum(ratios) / 2)  # median of two = their mean
    assert row.target_prefill_median_s > 0 and row.map_median_s > 0
    assert bench.crossfamily.all_refused
    md = (out / "bench.md").read_text()
    assert "| root>finetuned | 512 | reprefill |" in md and "TokenizerMismatchError" in md
