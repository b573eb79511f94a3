"""benchmarks/evaluate_family.py: the summary reads the served row and the best repair within 10 % and 15 %."""

from __future__ import annotations

import pytest

from tests.benchmarks.conftest import load_script


@pytest.fixture(scope="module")
def ef():
    return load_script("evaluate_family")


def _row(method, kl, top1, planned=None, measured=None, token_share=0.0, map_s=0.1):
    return {"method": method, "kl": kl, "top1": top1, "top5": 1.0, "nll_delta": 0.0, "greedy_agreement": None,
            "map_seconds": map_s, "prefill_seconds": 0.0, "cost_fraction": planned, "measured_cost": measured,
            "token_share": token_share}


def _report():
    return {"mapping_method": "anchored_kl", "reference_prefill_seconds": 10.0, "source_prefill_seconds": 10.0,
            "windows": 2, "prefix_tokens": 3584, "suffix_tokens": 128, "methods": [
                _row("reprefill", 0.0, 1.0, 1.0, 1.0, 1.0), _row("identity", 0.04, 0.9, 0.0, 0.0),
                _row("anchored_kl", 0.03, 0.92, 0.0, 0.0), _row("anchored_kl+sinks4", 0.012, 0.95, 0.01, 0.011),
                _row("anchored_kl+repair@10%", 0.005, 0.98, 0.1, 0.099),
                _row("anchored_kl+repair@12%", 0.004, 0.985, 0.12, 0.125),  # measured over 12 %: not within 12 %
                _row("anchored_kl+repair@15%", 0.0035, 0.99, 0.15, 0.16)]}  # measured over 15 %


def test_summary_reads_the_served_map_and_the_best_repair_within_each_cost(ef):
    line = ef._summary("finetuned", _report())
    assert line.startswith("| finetuned | anchored_kl | 0.0120 / 0.950 | 0.0300 | 0.0400 | yes | 1.00% |")
    assert "| repair@10%: KL 0.0050, top-1 0.980, measured 9.9% | repair@12%: KL 0.0040" in line
    assert line.endswith("| 1.07x |")  # the worst measured / planned of the repair rows (16 % / 15 %)


def test_served_falls_back_to_the_pure_map_and_cost_lines_flag_overruns(ef):
    report = _report()
    report["methods"] = [r for r in report["methods"] if "+sinks" not in r["method"]]
    assert ef._served(report)["method"] == "anchored_kl"
    lines = ef._cost_lines("finetuned", _report())
    assert len(lines) == 3 and "within 1.2x" in lines[0] and "planned 10.0%, measured 9.9%" in lines[0]
