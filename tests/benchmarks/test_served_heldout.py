"""benchmarks/served_heldout.py: windows pool by scored token, top-1 carries its interval, the tables read both views."""

from __future__ import annotations

import pytest

from orchestra.bench import wilson
from tests.benchmarks.conftest import load_script


@pytest.fixture(scope="module")
def sh():
    return load_script("served_heldout")


def test_windows_pool_by_scored_token_with_a_wilson_interval(sh):
    windows = [{"kl": 0.010, "top1": 125 / 128}, {"kl": 0.004, "top1": 1.0}, {"kl": 0.007, "top1": 120 / 128}]
    p = sh.pool(windows)
    assert p["scored_tokens"] == 3 * 128 and p["top1_hits"] == 125 + 128 + 120
    assert p["top1"] == pytest.approx(373 / 384)
    assert p["kl"] == pytest.approx(0.007)
    # the interval holds the estimate, is narrower than the whole range, and shrinks with more tokens
    assert p["top1_low"] < p["top1"] < p["top1_high"] <= 1.0
    wider = sh.pool(windows[:1])
    assert wider["top1_high"] - wider["top1_low"] > p["top1_high"] - p["top1_low"]


def test_the_heldout_texts_leave_out_every_calibration_text(sh):
    from orchestra.documents.texts import CALIBRATION_TEXTS, HELDOUT_TEXT

    texts = sh.heldout_texts()
    assert HELDOUT_TEXT in texts
    assert not set(texts) & set(CALIBRATION_TEXTS)


def test_tables_read_the_ungated_map_and_the_gated_path(sh):
    def pooled(kl, hits, n=256):
        low, high = wilson(hits, n)
        return {"windows": n // 128, "scored_tokens": n, "kl": kl, "top1": hits / n, "top1_hits": hits,
                "top1_low": low, "top1_high": high}

    res = {"member": "finetuned", "method": "anchored_kl", "calibration_tokens": 8192,
           "calibrated_at": "2026-12-07T03:40:30+00:00",
           "texts": [{"text": "gpl-3.txt", "tokens": 8000, "windows": 2}],
           "sinks": pooled(0.0119, 242),
           "mapped": [{"tail": 64, **pooled(0.0084, 248), "planned_cost": 0.025}],
           "served": [{"tail": 32, **pooled(0.0050, 250), "mapped_windows": 1,
                       "mapped_only": {**pooled(0.0100, 122, 128)}},
                      {"tail": 64, **pooled(0.0, 256), "mapped_windows": 0, "mapped_only": {"windows": 0}}]}
    md = sh.markdown(res, "python benchmarks/served_heldout.py")
    assert "gpl-3.txt (2)" in md and "fitted on 8,192 tokens" in md
    assert "| 0 (sinks only) | 0.0119 | 0.945 (242/256) |" in md
    assert "| 64 | 0.0084 | 0.969 (248/256) |" in md and "| 2.5% |" in md
    assert "| 32 | 1 of 2 | 0.0050 | 0.977 (250/256) |" in md and "| 0.0100 / 0.953 |" in md
    # a tail whose every window fell back has no mapped-only reading
    assert md.rstrip().splitlines()[-1].startswith("| 64 | 0 of 2 |") and md.rstrip().endswith("| - |")
